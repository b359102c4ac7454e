"""The training loop's clock: when to sync, each step's progress and accumulation, and when to stop.

The loop asks three things of a Clock, in this order, and the fake-clock tests drive it with the same calls:
    clock.due(step)           -> sync now? (a host sync costs a device round trip: about every --log_every_s)
    clock.sync(step, ...)     -> at a sync, with numbers all ranks agree on: the stop reason, or None to go on
    clock.begin_step(step)    -> (progress in [0, 1] for the schedule, this step's accumulation)
Time is measured per accumulation micro-step (unit_s): a step's time is unit_s x its accumulation, so the forecasts
stay right when a replan changes the accumulation mid-run. Pure arithmetic, no sleeping.
"""

import math

# plan at most this fraction of --max_steps: a device 5% faster in the second half of the run (after the last replan)
# still ends on the clock, not on the cap; the last step is planned exactly, so no more slack is needed
STEP_HEADROOM = 0.95
# periodic validations together take at most VAL_SHARE of the budget, the final one FINAL_VAL_SHARE; before one is
# measured, a validation token is forecast to cost VAL_TOKEN_COST training tokens (a forward is a third of the FLOPs,
# run eagerly and unfused)
VAL_SHARE = 0.1
FINAL_VAL_SHARE = 0.25
VAL_TOKEN_COST = 0.5
FILL_SLACK = 0.02  # a replan takes the smallest accumulation whose whole steps fill the rest of the budget within this
# a device slower than forecast: when the run would end with fewer than SHORT_OF_CAP of the steps the cap allows, the
# accumulation goes down to the smallest whose steps stay DOWN_MARGIN inside the cap (a faster stretch still fits)
SHORT_OF_CAP = 0.9
DOWN_MARGIN = 0.05
# a first step that outlasted the whole budget was a compile when a step is forecast at this share of it or less: one
# step at the floor then follows it (a first step that was one slow step gets no second one past the budget)
COMPILE_STEP_SHARE = 0.1
# a job stops for its wall at the last sync at least this many steps before it (the rest of the way to the SLURM end
# is --slurm_reserve_s, for the saves)
WALL_STEPS = 2


def steps_between(t0, t1, unit_s, accum):
    """Steps (a real number) that run from t0 to t1 seconds when a step takes unit_s x accum."""
    return max(t1 - t0, 0.0) / (unit_s * accum)


def last_step(step, fit, elapsed, budget_s, reserve_s, max_steps, planned_last):
    """Index of the last step to run, or None to stop now, when `fit` whole steps fit in what is left of the budget
    after reserve_s for planned validation. When none fits any more but the planned last step has not run, it still
    starts inside the budget (and ends less than a step past it), so the run always ends on its floor-LR step. No
    whole step of slack: with the organizers' step cap a step can be ~1/7 of the budget."""
    if fit < 1:
        return step if step <= planned_last and elapsed < budget_s - reserve_s else None
    return min(max_steps - 1, step + fit - 1)


def next_sync(step, last, step_s, log_every_s):
    """The step of the next host sync: about every log_every_s, and at least twice more before the last step,
    so a late slowdown still moves the plan."""
    return step + max(1, min(int(log_every_s / step_s), (last - step) // 2))


def progress(step, last, end_forecast_s, start_s, end_s, cap_share, previous):
    """Schedule progress of step (0-based): how far from start_s (the end of the compile step) to end_s (the budget)
    the clock forecasts this step to end, or cap_share, the step cap's share
    (step + 1) / max_steps, whichever is ahead; exactly 1 at the planned last step; never back. Time, so a slow stretch
    moves it smoothly; a run the cap ends early is keyed to its steps, so it is deterministic. The schedule's time
    starts after compilation, so a compile of any length leaves the whole schedule (stable phase, then decay) to the
    steps that follow it."""
    if step >= last:
        return 1.0
    return min(1.0, max(previous, (end_forecast_s - start_s) / max(end_s - start_s, 1e-9), cap_share))


def replanned_accum(step, max_steps, accum, min_accum, steps_left):
    """The late accumulation for the measured speed, or None to keep the current one. steps_left(accum) -> (steps that
    fit, a real number; seconds those whole steps use). Up, when the steps would overrun STEP_HEADROOM x max_steps: the
    smallest that fits, unless a larger one fills more than FILL_SLACK more of the rest (with few steps left the
    rounding matters: 29 s and 5 steps of 0.5 s per accumulation take 11, not 10; with many, more steps matter: an
    early replan once took 9 for 5 to fill 1% more, and trained 20 steps, not 37). Down, never below min_accum, when
    the run would end short of the cap (SHORT_OF_CAP): among those with more whole steps that stay DOWN_MARGIN inside
    it, the smallest, by the same fill rule."""
    available = max(int(STEP_HEADROOM * max_steps) - step, 1)
    if int(steps_left(accum)[0]) <= available:
        steps = steps_left(accum)[0]
        if steps >= SHORT_OF_CAP * available:
            return None
        room = [a for a in range(min_accum, accum) if int(steps) < steps_left(a)[0] <= (1 - DOWN_MARGIN) * available]
        used = {new: steps_left(new)[1] for new in room if int(steps_left(new)[0]) > int(steps)}
        return min((new for new in used if used[new] >= (1 - FILL_SLACK) * max(used.values())), default=None)
    smallest = accum + 1
    while int(steps_left(smallest)[0]) > available:
        smallest = max(smallest + 1, math.ceil(smallest * steps_left(smallest)[0] / (available + 1)))
    while smallest > accum + 1 and int(steps_left(smallest - 1)[0]) <= available:  # the jump may overshoot
        smallest -= 1
    used = {new: steps_left(new)[1] for new in range(smallest, 2 * smallest + 1)}
    return min(new for new in used if used[new] >= (1 - FILL_SLACK) * max(used.values()))


# what a resumed run's clock takes on from the one it continues (state_dict); the rest comes from the run's flags
RESUMED = (
    "accum", "planned_unit_s", "val_token_s", "unit_s", "compile_s", "last", "start_s", "end_s", "prev_step",
    "prev_elapsed", "prev_paused", "units", "prev_units", "done", "step_accum",
)  # fmt: skip


class Clock:
    """The loop's time keeping, fed at every host sync with numbers all ranks agree on, so they decide alike:
    the steady micro-step time (pauses taken out), what the periodic validations still to come may take, the late
    accumulation (replanned both ways in the first half of the budget, so that a binding step cap is filled, never
    overrun), the last step and the next sync. A budget that spans jobs stops each job before its wall ("wall")."""

    def __init__(
        self,
        budget_s,
        max_steps,
        accum,
        log_every_s,
        may_replan,
        planned_step_s,
        micro_tokens=1,
        val_every_s=0.0,
        val_until_s=0.0,
        val_batches=0,
        val_tokens=0,
        min_accum=1,
        progress_by_steps=False,
    ):
        self.budget_s, self.max_steps, self.accum, self.log_every_s = budget_s, max_steps, accum, log_every_s
        self.may_replan, self.micro_tokens, self.notes = may_replan, micro_tokens, []
        self.min_accum = min(min_accum, accum)  # a replan never goes below the recipe's batch
        self.progress_by_steps = progress_by_steps
        self.planned_unit_s = planned_step_s / accum  # the plan's forecast, until step 2 measures one
        self.val_every_s, self.val_until_s = val_every_s, val_until_s  # periodic validation stops at val_until_s
        self.val_batches, self.val_tokens, self.val_token_s = val_batches, val_tokens, None
        self.unit_s, self.compile_s, self.last, self.sync_at = None, 0.0, max_steps - 1, 0
        self.start_s = 0.0  # the schedule's time starts when the compile step ends
        self.end_s = budget_s  # forecast end of training: the budget, or sooner when the step cap binds
        self.prev_step, self.prev_elapsed, self.prev_paused = 0, 0.0, 0.0
        self.units, self.prev_units = 0, 0  # accumulation micro-steps begun in all, and at the last sync
        self.done, self.step_accum = 0.0, accum
        self.rebase = False  # a resumed job's first step compiles: its time is no step's
        self._said = set()

    def state_dict(self):
        return {name: getattr(self, name) for name in RESUMED}

    def load_state_dict(self, state):
        """Continue the clock a state_dict was taken of: the first step after it (a compile) is synced after and not
        measured."""
        for name in RESUMED:
            setattr(self, name, state[name])
        self.sync_at, self.rebase = self.prev_step + 1, True

    @classmethod
    def for_run(cls, run, budget_s):
        """The clock of a launch.Run: its flags and plan. Periodic validation stops where the decay starts: the final
        one measures the end, and the decay runs unbroken."""
        hp, plan = run.hp, run.plan
        return cls(
            budget_s,
            hp.max_steps,
            plan.grad_accum_steps,
            hp.log_every_s,
            may_replan=hp.batch_tokens is None,
            planned_step_s=plan.step_s,
            micro_tokens=plan.micro_batch * hp.seq_len,
            val_every_s=hp.val_every_min * 60,
            val_until_s=budget_s * (1 - hp.decay_frac),
            val_batches=len(run.val),
            val_tokens=sum(y.numel() for _, y in run.val),
            min_accum=plan.min_accum,
            progress_by_steps=hp.progress_by == "steps",
        )

    @property
    def step_s(self):
        """Forecast seconds of the current step: measured, or the plan's until a step is measured."""
        return (self.unit_s or self.planned_unit_s) * self.step_accum

    def _say_once(self, key, note):
        if key not in self._said:
            self._said.add(key)
            self.notes.append(note)

    def due(self, step):
        """Whether the loop takes a host sync before this step."""
        return step >= self.sync_at or step > self.last

    def begin_step(self, step):
        """(progress of this step for the schedule, its accumulation); the starter's progress_by_steps is blind to
        the clock, kept to measure what that costs."""
        if self.progress_by_steps:
            self.done = (step + 1) / self.max_steps
        else:
            forecast, cap_share = self._end_forecast(step), (step + 1) / self.max_steps
            self.done = progress(step, self.last, forecast, self.start_s, self.budget_s, cap_share, self.done)
        self.step_accum = self.accum
        self.units += self.step_accum
        return self.done, self.step_accum

    def _end_forecast(self, step):
        """When this step is forecast to end, in seconds on the clock."""
        return self.prev_elapsed + (step - self.prev_step + 1) * self.step_s

    def _steps_left(self, elapsed, reserve_s, accum):
        """(steps that fit in the rest of the budget with this late accumulation, a real number; seconds they use)."""
        end = self.budget_s - reserve_s
        steps = steps_between(elapsed, end, self.unit_s, accum)
        return steps, end - elapsed - (steps - int(steps)) * self.unit_s * accum

    def _val_batch_s(self):
        """Forecast seconds of a validation batch: from the measured cost of a validation token or, before one is
        measured, VAL_TOKEN_COST x a training token's."""
        unit_s = self.unit_s or self.planned_unit_s  # measured whenever a validation is planned
        token_s = self.val_token_s or VAL_TOKEN_COST * unit_s / self.micro_tokens
        return token_s * self.val_tokens / self.val_batches

    def _val_count(self):
        """Periodic validations the run is forecast to take."""
        return max(1, int(min(self.val_until_s, self.end_s) / self.val_every_s))

    def _batches_per_validation(self):
        """(batches one periodic validation scores, its forecast seconds): the whole set, or as many batches as fit
        in its share of the forecast training time."""
        batch_s = self._val_batch_s()
        batches = min(self.val_batches, int(VAL_SHARE * self.end_s / self._val_count() / batch_s))
        return batches, batches * batch_s

    def final_validation_batches(self):
        """Batches the final validation scores: all of them, or at least one and as many as fit in FINAL_VAL_SHARE
        of the budget (it runs after the clock, but before the job's wall)."""
        if self.unit_s is None and self.val_token_s is None:
            return self.val_batches
        batch_s = self._val_batch_s()
        batches = max(1, min(self.val_batches, int(FINAL_VAL_SHARE * self.budget_s / batch_s)))
        if batches < self.val_batches:
            self.notes.append(
                f"validation: the final one scores {batches} of {self.val_batches} batches (~{batches * batch_s:.2g} "
                f"s), at most {FINAL_VAL_SHARE:.0%} of the budget; lower --val_eval_tokens to score them all"
            )
        return batches

    def validation_batches(self, elapsed, last_val):
        """How many validation batches to score now: 0 when none is due (or the step time is not measured yet, or
        not even one batch fits in a validation's share of the budget)."""
        due = self.val_every_s > 0 and elapsed - last_val >= self.val_every_s and elapsed < self.val_until_s
        if not due or self.unit_s is None or not self.val_batches:
            return 0
        batches, forecast_s = self._batches_per_validation()
        if batches == 0:
            self._say_once(
                "skip",
                f"validation: skipped; one batch would outlast a validation's share of the budget "
                f"({VAL_SHARE:.0%} over {self._val_count()} validations); the final one still runs",
            )
        elif batches < self.val_batches:
            self._say_once(
                "shrink",
                f"validation: {batches} of {self.val_batches} batches per periodic validation (~{forecast_s:.2g} s), "
                f"so that together they take at most {VAL_SHARE:.0%} of the budget; the final one is planned apart",
            )
        return batches

    def _measure(self, step, elapsed, paused):
        """Take the micro-step time from the steps since the last sync (the first step carries compilation)."""
        units = self.units - self.prev_units
        interval = (elapsed - self.prev_elapsed - (paused - self.prev_paused)) / max(units, 1)
        if self.rebase:
            self.rebase = False
        elif step == 1:
            self.compile_s = self.start_s = elapsed
            # the first step (compile and warm-up included) bounds a step: a forecast slower than it plans too few
            self.planned_unit_s = min(self.planned_unit_s, interval)
        elif step > 1 and units:
            if self.unit_s is not None and interval > 3 * self.unit_s:
                self.notes.append(
                    f"stall: {(interval - self.unit_s) * units:.1f} s lost between steps {self.prev_step} and {step}"
                )
            self.unit_s = interval if self.unit_s is None else 0.5 * self.unit_s + 0.5 * interval
        self.prev_step, self.prev_elapsed, self.prev_paused, self.prev_units = step, elapsed, paused, self.units

    def sync(self, step, elapsed, paused, val_token_s, wall_left_s=math.inf):
        """Take the clock after `step` steps: elapsed and paused (validation, saves) seconds, val_token_s, what a
        validation token took (0 before the first validation), and wall_left_s, the seconds to this job's wall when the
        budget spans jobs. Returns the stop reason, or None to go on."""
        self._measure(step, elapsed, paused)
        self.val_token_s = val_token_s or self.val_token_s
        if step >= self.max_steps:
            return "max_steps"
        if wall_left_s < WALL_STEPS * self.step_s:
            return "wall"
        reserve_s = 0.0
        if self.val_every_s > 0 and self.unit_s is not None:
            future_vals = max(math.ceil((self.val_until_s - elapsed) / self.val_every_s), 0)
            reserve_s = future_vals * self._batches_per_validation()[1]
        # in the first half of the time after the compile step: later, the batch stays through the decay
        if self.may_replan and self.unit_s is not None and elapsed < (self.start_s + self.budget_s) / 2:
            # the device is not the forecast: the accumulation follows it, so the run ends near the step cap's steps
            new = replanned_accum(
                step, self.max_steps, self.accum, self.min_accum, lambda a: self._steps_left(elapsed, reserve_s, a)
            )
            if new is not None:
                why = "the budget fits in --max_steps" if new > self.accum else "the steps fill --max_steps"
                self.notes.append(
                    f"replan: {self.unit_s * self.accum * 1e3:.4g} ms/step measured; accumulation {self.accum} -> "
                    f"{new} so {why}"
                )
                self.accum, self.step_accum = new, min(self.step_accum, new)
        if self.unit_s is None:  # steps 0-1: the plan's forecast (the compile step says nothing of the steps after)
            fit = int((self.budget_s - elapsed - reserve_s) / self.step_s)
        else:
            fit = int(self._steps_left(elapsed, reserve_s, self.accum)[0])
        planned = last_step(step, fit, elapsed, self.budget_s, reserve_s, self.max_steps, self.last)
        if planned is None and step == 1 <= self.last and self.step_s <= COMPILE_STEP_SHARE * elapsed:
            planned = 1  # the compile outlasted the budget: the run still ends on a floor-LR step
            self.notes.append(
                f"the first step (compiling) took {elapsed:.0f} s, past the budget: one step at the floor LR follows"
            )
        if planned is None:
            return "time_limit" if step > 0 else None
        self.last = planned
        if self.unit_s is None:
            self.sync_at = step + 1  # steps 0-1: compile time, then the first measured step
        else:
            late_step_s = self.unit_s * self.accum
            self.sync_at = next_sync(step, self.last, self.step_s, self.log_every_s)
            self.end_s = min(self.budget_s, elapsed + reserve_s + (self.last - step + 1) * late_step_s)
        if math.isfinite(wall_left_s):  # the next sync comes before the wall
            self.sync_at = min(self.sync_at, step + max(1, int(wall_left_s / self.step_s) - WALL_STEPS))
        return None

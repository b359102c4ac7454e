"""Time-boxed GPT pretraining: one flat loop, keyed to the wall clock.

    python train.py                                  # 1 process: CUDA if present, else CPU
    torchrun --nproc_per_node=8 train.py --data_dir /home/data/
    sbatch submit_slurm.sh                           # 4 nodes x 8 GPUs
    python train.py --dry_run --world_size 32 --peak_tflops 2250 --device_memory_gib 288   # the event plan

Before the clock (launch.py): every check, the run plan (shape, tokens per step, micro-batch, forecast), the model,
the step-0 checkpoint and one of each collective; then all ranks start the clock together. A Trainer runs the loop:
the schedule is a function of progress, the clock's forecast of elapsed / budget, or step / max_steps if that is
ahead, and exactly 1 at the last step, which is re-planned from the measured step time at every host sync. Whichever
limit binds, warmup, stable and decay all happen and the last step runs at the floor LR.
"""

import gc
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from config import check_flags, overridden_flags, parse_args
from checkpoint import CheckpointError
from clock import Clock
from rollback import Guard
from tailema import TailEMA
from windows import DataChanged
from headloss import head_loss
from deadline import agreed_budget
from launch import dry_run, launch
from kernels import agreed_attention, compile_counts, failed_in_attention, forget_compiles, next_attention
from kernels import switch_attention
from ranks import StopSignals, end_ranks, fail, failing_ranks, first_line, lost_peers, rank_span, say_on_rank0
from ranks import stop_with_the_launcher
from schedule import batch_lr_scale, schedule, set_lrs
from streams import guard_log_streams
from report import Logger, StepProfile, close_metrics, human_summary, process_age_s, summary_row
from resume import loop_state, restore_loop


def main(argv=None):
    parent = os.getppid()  # the launcher, as early as this process can look
    guard_log_streams()  # a log stream that goes away (a killed tee, a hang-up, a full disk) never ends the run
    stop_signals = StopSignals()  # from here on: finish the current step (or micro-step), save, validate, exit 0
    stop_with_the_launcher(parent)
    hp, model_switches, unknown = parse_args(argv)
    say = say_on_rank0
    if unknown:
        say(f"ignoring unknown flags: {' '.join(unknown)}")
    try:  # flag errors are the same on every rank: each exits on its own
        check_flags(hp, model_switches)
    except ValueError as e:
        fail(f"error: {e}")
    for sentence in overridden_flags(hp):
        say(f"warning: {sentence}")
    if hp.dry_run:
        dry_run(hp, model_switches, say)
        return
    with lost_peers(" before training", "no step ran"):
        run = launch(hp, model_switches, stop_signals, say)
    with lost_peers("", f"{run.hp.checkpoint_path} holds the last save", on_lost=lambda: abandon(run)):
        with run.attention.active():  # once, around loop and finish: step 0 traces and validation run under it
            saved = Trainer(run).train()
    end_ranks(0 if saved else 1, run.device)  # a failed final save: rank 0 meets the others, then exits 1


def abandon(run):
    """A peer lost mid-run: the background save finished and the metrics rows written, before the exit."""
    run.checkpointer.wait()
    close_metrics(run)


@torch.no_grad()
def evaluate(model, batches, device, amp):
    """Mean next-token loss over these validation batches of this rank, averaged over ranks. Eager and without
    autograd, so validation compiles no graph of its own whatever its batch shapes, and costs less than the
    training graphs would (BENCHMARKS.md: at l16w128 on CPU, 754 ms a batch against 1,350 ms compiled with grad on,
    where the head's gradients are taken in forward)."""
    model.eval()
    total, count = torch.zeros((), device=device), 0
    with torch.compiler.set_stance("force_eager"):
        for x, y in batches:
            with amp:
                _, loss = model(x.to(device), y.to(device), loss_fn=head_loss)
            total += loss.float() * y.numel()  # token-weighted: the last batch may be smaller
            count += y.numel()
    model.train()
    stats = torch.stack([total, torch.tensor(float(count), device=device)])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


# steps longer than this look for a stop signal between micro-steps too (one all-reduce of a flag each, on several
# ranks): a stop is then honoured within a micro-step, inside SLURM's 30 s between SIGTERM and SIGKILL
STOP_CHECK_S = 5.0


class Trainer:
    """One run's loop, over the Run that launch.py built (read, never changed): the loop's state and its collaborators
    (the clock, the metrics, the rollback guard, the tail EMA, the profiler). train() runs train_step until a host sync
    or a step says stop, then finish() saves, validates and reports."""

    def __init__(self, run, clock=None, log=None, guard=None, ema=None):
        """The collaborators are made from the run, unless given (a test's fake clock, say)."""
        self.run, self.hp = run, run.hp
        bf16 = self.hp.autocast == "bf16"
        self.amp = torch.autocast(run.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        self.trained_s = run.resumed.meta["trained_s"] if run.resumed else 0.0  # by the jobs before this one
        self.clock = clock or Clock.for_run(run, agreed_budget(run, self.trained_s))
        self.log = log or Logger(run, self.clock)
        self.guard = guard or Guard(run.raw_model, run.optimizers, run.device, run.say)
        self.ema = ema or TailEMA(run.raw_model, self.hp.tail_ema, self.hp.tail_ema_horizon)
        self.profile = StepProfile(run, self.clock) if self.hp.profile and run.rank == 0 else None
        self.attention = run.attention  # step 0 moves down the backends when it fails inside one
        self.loss_sum = torch.zeros(2, device=run.device)  # since the last host sync: the losses, the steps that count
        self.step, self.tokens, self.lr_frac, self.progress = 0, 0, 0.0, 0.0
        self.paused = 0.0  # seconds on the clock spent validating, saving and profiling, on this rank
        self.val_token_s, self.last_save, self.last_val = 0.0, 0.0, 0.0
        self.stop_reason = None
        self.data_gone = None  # this rank's DataChanged, carried to every rank by the next host sync
        self.compile_fallback, self.compile_fallback_ranks = None, []  # the first failing rank's reason; every rank
        self.weights = "plain"  # what the final checkpoint holds: plain weights, or the tail EMA's blend
        self.train_s, self.clock_start_unix, self.startup_s = 0.0, 0.0, None  # train_s: every job's, this one's too
        self.jobs = []  # the jobs before this one: {"train_s", "steps", "stop_reason"} each
        self.resumed_from = None  # the loader's place when a step stopped between micro-steps: the next job's
        if run.resumed:
            restore_loop(self, run.resumed.meta, run.resumed.ema_average)
        self.first_step = self.step  # this job's: it compiles

    def train(self):
        """The loop, then finish(); returns whether the final save succeeded."""
        gc.collect()
        gc.disable()  # a collection pause on one rank stalls all of them
        # the clock starts right before the first forward pass, on every rank together (where earlier jobs left it)
        t0 = time.perf_counter() - self.trained_s
        self.clock_start_unix, self.startup_s = time.time(), process_age_s()
        while True:
            if self.clock.due(self.step) and (stop := self.host_sync(time.perf_counter() - t0)):
                self.stop_reason = stop
                break
            if self.profile:
                self.profile.begin(self.step)
            if not self.train_step():
                break
            if self.profile:
                self.paused += self.profile.end(self.step)
        if self.profile:
            self.paused += self.profile.close(self.step)
        self.train_s = time.perf_counter() - t0
        gc.enable()
        self.run.loader.close()
        return self.finish()

    def train_step(self):
        """One optimizer step: progress and accumulation from the clock, each group's LR from the schedule, the
        micro-steps, the optimizers. False when it stopped between micro-steps (its gradients dropped; stop_reason
        says why)."""
        run, hp = self.run, self.hp
        self.progress, accum = self.clock.begin_step(self.step)
        position = run.loader.position
        step_tokens = run.world * run.plan.micro_batch * hp.seq_len * accum
        self.lr_frac, momentum = schedule(self.progress, hp)
        run.raw_model.set_progress(self.progress)  # model.py's untie_at
        set_lrs(run.optimizers, hp, self.lr_frac, momentum, step_tokens, run.device.type, self.guard.lr_scale)
        try:
            if self.step == self.first_step and hp.compile:
                step_loss = self.first_compiled_step(accum)
            else:
                step_loss = self.accumulate(accum, check_stop=run.world == 1 or self.clock.step_s > STOP_CHECK_S)
        except DataChanged as e:  # the weights trained so far are saved, with one message
            run.say(f"stopping: {e}")
            step_loss, self.stop_reason = None, "data"
        if step_loss is None:
            run.model.zero_grad(set_to_none=True)
            self.stop_reason, self.resumed_from = self.stop_reason or "signal", position
            return False
        for opt in run.optimizers:
            opt.step()
        # with several ranks kept, not freed: they stay views of DDP's buckets, so the next sync copies nothing into
        # them (2 gloo ranks: 0.89x the step on CPU; one process has no buckets and measured 1.08x: freed). Every
        # parameter gets a gradient each step, so the optimizers' `grad is None` skips mean what they meant
        run.model.zero_grad(set_to_none=run.world == 1)
        self.loss_sum += step_loss
        self.step += 1
        self.tokens += step_tokens
        return True

    # ------------------------------------------------------------------------- the micro-steps

    def accumulate(self, accum, check_stop=False):
        """Forward and backward of one optimizer step's micro-batches: (the mean loss, the share of the step's batches
        that count), one tensor (no host sync), or None when check_stop found a stop signal between micro-steps
        (agreed across ranks). A stand-in batch (next_batch: weight 0) counts in neither."""
        run = self.run
        step_loss = torch.zeros(2, device=run.device)
        for micro in range(accum):
            if check_stop and micro and self.stop_agreed():
                return None
            (x, y), weight = self.next_batch()
            # gradients are all-reduced once per optimizer step, on the last micro-step
            with run.model.no_sync() if run.world > 1 and micro < accum - 1 else nullcontext():
                with self.amp:
                    _, loss = run.model(x, y, loss_fn=run.loss_fn)
                (loss * (weight / accum)).backward()
            step_loss += torch.stack([loss.detach().float(), loss.new_ones((), dtype=torch.float32)]) * (weight / accum)
        return step_loss

    def next_batch(self):
        """(the next micro-batch, its loss weight). Once this rank's data is gone (DataChanged) in a multi-rank run, a
        stand-in batch of the same shape with weight 0: the rank keeps meeting the others in the gradient all-reduce
        until the next host sync stops every rank together ("data"), instead of leaving them in a collective."""
        run = self.run
        if self.data_gone is None:
            try:
                return next(run.loader), 1.0
            except DataChanged as e:
                if run.world == 1:
                    raise
                self.data_gone = str(e)
                print(f"rank {run.rank}: {e} Stopping every rank at the next host sync.", file=sys.stderr, flush=True)
        stand_in = torch.zeros(run.plan.micro_batch, self.hp.seq_len, dtype=torch.long, device=run.device)
        return (stand_in, stand_in), 0.0

    def stop_agreed(self):
        run = self.run
        if run.world == 1:
            return run.stop_signals.received
        flag = torch.tensor([float(run.stop_signals.received)], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def first_compiled_step(self, accum):
        """Step 0, which compiles every graph training uses: first in a trial micro-step (compiled_trial) that takes
        no collective, so ranks can agree on what failed before any gradient all-reduce. When it fails inside the
        attention backend on any rank, every rank moves down the backends (kernels.next_attention, agreed) and
        compiles again, each rank that failed saying so on its stderr and rank 0 once for all; elsewhere (a Triton or
        ptxas that does not know the GPU; on CPU, no working C++ compiler) the rank runs step 0 and the rest of the
        run eagerly, and the clock measures its step time from step 1 on. Every rank learns which ranks fell back
        (one all-reduce; the reason travels only on failure), since all ranks wait for an eager one: one line names
        them. Returns accumulate's loss and count."""
        run = self.run
        counts = compile_counts()  # graphs compiled under a backend left behind are not the run's
        why, in_attention = self.compiled_trial()
        while (failed := failing_ranks(why if in_attention else None, run.device, run.world, run.rank)).ranks:
            if (rest := next_attention(self.attention)) is None:
                break
            if in_attention:
                print(f"rank {run.rank}: step 0 failed inside attention {self.attention.name} ({why})", file=sys.stderr)
            rest = agreed_attention(rest, run.device, run.world)
            where = "" if run.world == 1 else f" on {rank_span(failed.ranks)} of {run.world}"
            run.say(
                f"warning: step 0 failed inside attention {self.attention.name}{where} ({failed.first_error}); every "
                f"rank compiles again under {rest.label}, op {rest.op}"
            )
            for note in rest.notes:
                run.say(note)
            forget_compiles(counts)
            self.attention = switch_attention(rest)
            why, in_attention = self.compiled_trial()
        if why is not None:
            torch.compiler.set_stance("force_eager")
        step_loss = self.accumulate(accum)
        if why is None:  # after step 0 no recompile may stall the clock: a guard miss raises, EagerRuns runs it eagerly
            torch.compiler.set_stance("fail_on_recompile")
        self.compile_fallback_ranks, self.compile_fallback = failing_ranks(why, run.device, run.world, run.rank)
        if eager := self.compile_fallback_ranks:
            where = "" if run.world == 1 else f" on {rank_span(eager)} of {run.world}"
            wait = "" if run.world == 1 else " there, and every rank waits for them"
            run.say(
                f"warning: compiling failed at the first step{where} ({self.compile_fallback}); training goes on "
                f"eagerly{wait}"
            )
        return step_loss

    def compiled_trial(self):
        """One compiled micro-step of step 0's shape on a stand-in batch (every graph compiles in it: backward graphs in
        the first forward, launch.py), its gradients dropped, under DDP's no_sync: no collective. Returns (None,
        False), or where compiling or running it failed (a lost peer is raised) its reason and whether it failed
        inside attention (kernels.failed_in_attention)."""
        run = self.run
        x = torch.zeros(run.plan.micro_batch, self.hp.seq_len, dtype=torch.long, device=run.device)
        try:
            with run.model.no_sync() if run.world > 1 else nullcontext():
                with self.amp:
                    _, loss = run.model(x, x, loss_fn=run.loss_fn)
                loss.backward()
            return None, False
        except Exception as e:
            if isinstance(e, dist.DistError):
                raise
            return f"{type(e).__name__}: {first_line(e)}", failed_in_attention(e)
        finally:
            run.model.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------- host syncs

    def host_sync(self, elapsed):
        """One all-reduce for the slowest rank's clock, its pauses, any stop signal and a rank whose data is gone; the
        metrics row and the divergence test (take_loss), the clock's decision, then what it plans into the pause
        (pause). Returns the stop reason, or None to go on."""
        run = self.run
        data_rank = run.rank + 1 if self.data_gone else 0  # which rank's data is gone, if any: every rank stops with it
        signalled = float(run.stop_signals.received)
        wall_left = run.deadline - time.time() if self.hp.budget_spans_jobs else math.inf
        mine = [elapsed, self.paused, self.val_token_s, signalled, data_rank, -wall_left]  # all taken by MAX
        stats = torch.tensor(mine, device=run.device)
        totals = self.loss_sum.clone()
        if run.world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            dist.all_reduce(totals)  # sums: the row is the mean over every rank's counted steps
        elapsed, paused_all, val_token_s_all, signalled, data_rank, wall_left = stats.tolist()
        loss_total, counted = totals.tolist()
        # counted is 0 only when every rank's batches since the last sync were stand-ins: the data stop below
        if counted > 0 and not self.take_loss(loss_total / counted, elapsed):
            return "diverged"
        stop = "signal" if signalled else self.clock.sync(self.step, elapsed, paused_all, val_token_s_all, -wall_left)
        if data_rank:
            run.say(f"stopping: rank {int(data_rank) - 1} has no training data left to read (its stderr says why)")
            stop = "data"
        self.log.notes()
        if run.rank == 0:
            self.log.failed_save(wait=False)
        if run.state_writer and (error := run.state_writer.poll()) and run.rank == 0:
            run.say(f"warning: {error}; training goes on")
        if stop:
            return stop
        self.loss_sum.zero_()
        pause_start = time.perf_counter()  # snapshots, validation and saves: planned by the clock, not steps
        self.pause(elapsed)
        self.paused += time.perf_counter() - pause_start
        return None

    def take_loss(self, loss, elapsed):
        """A sync's mean loss: its metrics row, then the guard's test: a rollback, or the tail EMA's update. False when
        the run diverged after its last rollback."""
        if math.isfinite(loss):
            self.log.row(self.step, self.tokens, elapsed, self.lr_frac, loss)
        if why := self.guard.diverged(loss):
            step_tokens = self.run.world * self.run.plan.micro_batch * self.hp.seq_len * self.clock.step_accum
            if not self.guard.roll_back(self.step, why, batch_lr_scale(step_tokens, self.hp, self.run.device.type)):
                return False
            self.ema.reset()
        else:
            self.ema.update(self.progress, self.step)
        return True

    def pause(self, elapsed):
        """What the clock plans into a sync's pause: a rollback snapshot, a background save, a periodic validation."""
        run, hp = self.run, self.hp
        self.guard.maybe_snapshot(self.step, self.tokens, elapsed)
        if hp.save_every_min > 0 and elapsed - self.last_save >= hp.save_every_min * 60:
            if run.rank == 0:
                self.log.failed_save()
                meta = self.log.meta(*self.guard.weights_of(self.step, self.tokens))
                run.checkpointer.save(run.raw_model, meta, background=True)
            self.last_save = elapsed
            if run.state_writer:  # every rank: its share of the tensors, its place in the data
                self.save_state(elapsed, background=True)
        if val_batches := self.clock.validation_batches(elapsed, self.last_val):
            val_start = time.perf_counter()
            val_loss = evaluate(run.raw_model, run.val[:val_batches], run.device, self.amp)
            self.log.emit(
                {"step": self.step, "elapsed_s": round(elapsed, 3), "tokens": self.tokens, "val_loss": val_loss}
            )
            val_tokens = sum(y.numel() for _, y in run.val[:val_batches])
            self.val_token_s, self.last_val = (time.perf_counter() - val_start) / val_tokens, elapsed

    # ------------------------------------------------------------------------- the end

    def finish(self):
        """After the clock: save first, then validate (a slow eval can never cost the checkpoint), then the summary.
        A run that diverged after its last rollback saves its last trusted snapshot, and exits 0; else the weights take
        in the tail EMA's blend, if it is on and its window opened (what the checkpoint and the validation score).
        The labels (weights, weights_step, the log's lines) say what the checkpoint on disk holds, on every path."""
        run = self.run
        diverged = self.stop_reason == "diverged"
        if run.state_writer and not diverged:  # before the blend: the state a next job goes on from
            self.save_state(self.train_s, background=False)
        if diverged:
            run.say(f"stopping: the loss diverged after {len(self.guard.rollbacks)} rollback(s)")
        elif self.stop_reason != "wall":  # a run that goes on in another job keeps its plain weights
            self.ema.update(self.progress, self.step)
            self.weights = self.ema.blend_in()
        if self.guard.restore_for_the_final_save(self.step, diverged=diverged):
            self.weights = "plain"  # the trusted snapshot's weights, whatever was blended before
        if self.weights != "plain":
            run.say(f"final weights: {self.weights}")
        step, tokens = self.guard.weights_of(self.step, self.tokens)  # what the checkpoint and validation hold
        saved = self.save_final(step, tokens) if run.rank == 0 else True
        val_batches = self.clock.final_validation_batches()
        self.log.notes()
        val_loss = evaluate(run.raw_model, run.val[:val_batches], run.device, self.amp)
        self.log.emit({"step": step, "elapsed_s": round(self.train_s, 3), "tokens": tokens, "val_loss": val_loss})
        summary = {**summary_row(run, self.clock, self, val_loss, val_batches), "rollbacks": self.guard.rollbacks}
        summary["jobs"] = [*self.jobs, self.job(self.train_s)]
        summary["weights_step"] = step  # below "steps" when the run ends on restored weights
        if not saved:  # the checkpoint on disk is an earlier save's (or none), not the weights validated
            held = run.checkpointer.on_disk or {}
            summary["weights"], summary["weights_step"] = held.get("weights"), held.get("step")
        self.log.emit(summary)
        self.log.close(self.train_s)
        run.say(human_summary(summary, self.hp))
        return saved

    # ------------------------------------------------------------------------- the state a next job goes on from

    def job(self, elapsed):
        """This job so far, as the state and the summary count jobs."""
        train_s = round(elapsed - self.trained_s, 3)
        return {"train_s": train_s, "steps": self.step - self.first_step, "stop_reason": self.stop_reason}

    def save_state(self, elapsed, background):
        """Every rank's share of the training state (resume.StateWriter), at a sync or after the clock; weights that
        are not finite are none to go on from (the final checkpoint takes the trusted snapshot instead)."""
        run = self.run
        if not all(bool(torch.isfinite(p).all()) for p in run.raw_model.parameters()):
            run.say("warning: the weights are not finite: no training state saved of them")
            return
        names = [n for n, _ in run.raw_model.named_parameters() if n != "wte.weight"]  # TailEMA's scope
        meta = loop_state(self, elapsed)
        try:
            run.state_writer.save(run.raw_model, run.optimizers, self.ema.average, names, meta, background)
        except Exception as e:  # the state named before stays named
            run.say(f"warning: the training state at step {self.step} was not saved ({first_line(e)})")

    def save_final(self, step, tokens):
        """Rank 0's final save; a failure is said (with what the checkpoint on disk holds instead) and returns False:
        rank 0 still validates with the others and meets them at the barrier."""
        run, path = self.run, self.hp.checkpoint_path
        self.log.failed_save()
        try:
            run.checkpointer.save(run.raw_model, self.log.meta(step, tokens, self.weights), background=False)
        except Exception as e:
            held = run.checkpointer.on_disk
            kept = f"step {held['step']}, the last save that succeeded" if held else "nothing: no save succeeded"
            why = str(e).rstrip(".") if isinstance(e, CheckpointError) else repr(e)[:300]
            run.say(f"error: the final save failed: {why}; {path} holds {kept}")
            return False
        run.say(f"saved {path} at step {step} ({self.stop_reason}) after {self.train_s:.1f}s")
        return True


if __name__ == "__main__":
    main()

"""Time-boxed GPT pretraining: one flat loop, keyed to the wall clock.

    python train.py                                  # 1 process: CUDA if present, else CPU
    torchrun --nproc_per_node=8 train.py --data_dir /home/data/
    sbatch submit_slurm.sh                           # 4 nodes x 8 GPUs
    python train.py --dry_run --world_size 32 --peak_tflops 2250 --device_memory_gib 288   # the event plan

Before the clock: every check, the run plan (shape, tokens per step, micro-batch, forecast), the model, the
step-0 checkpoint and one of each collective; then all ranks start the clock together. The schedule is a
function of progress: the clock's forecast of elapsed / budget, or step / max_steps if that is ahead, and exactly 1
at the last step, which is re-planned from the measured step time at every host sync. Whichever limit binds,
warmup, stable and decay all happen and the last step runs at the floor LR.
"""

import dataclasses
import functools
import gc
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from config import check_flags, overridden_flags, parse_args
from checkpoint import CheckpointError
from clock import Clock
from rollback import Guard
from tailema import TailEMA
from windows import DataChanged
from headloss import head_loss
from deadline import agreed_budget
from launch import dry_run, launch
from kernels import (
    agreed_attention,
    compile_counts,
    failed_in_attention,
    forget_compiles,
    next_attention,
    switch_attention,
)
from ranks import STOP_SIGNALS, fail, failing_ranks, lost_contact, rank_span, stop_with_the_launcher, why
from schedule import batch_lr_scale, mtp_weights, schedule, set_lrs
from streams import guard_log_streams
from report import Logger, StepProfile, close_metrics, human_summary, process_age_s, summary_row


# ----------------------------------------------------------------------------- the step's loss


def step_loss_fn(run, progress_frac):
    """The training loss of the step at progress: run.loss_fn, with --mtp at that progress's weights, copied to the
    device from pinned memory without waiting for it."""
    if not run.hp.mtp:
        return run.loss_fn
    weights = torch.tensor(mtp_weights(progress_frac), pin_memory=run.device.type == "cuda")
    return functools.partial(run.loss_fn, mtp_weights=weights.to(run.device, non_blocking=True))


# ----------------------------------------------------------------------------- main


def main(argv=None):
    parent = os.getppid()  # the launcher, as early as this process can look
    guard_log_streams()  # a log stream that goes away (a killed tee, a hang-up, a full disk) never ends the run
    stop_signal = []  # from here on: finish the current step (or micro-step), save, validate, exit 0
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), lambda sig, frame: stop_signal.append(sig))
    stop_with_the_launcher(parent)
    hp, model_switches, unknown = parse_args(argv)
    say = print_on_rank0
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
    try:  # a peer that dies in the checks', the plan's or the warm-up's collectives: one sentence, not a traceback
        run = launch(hp, model_switches, stop_signal, say)
    except RuntimeError as e:
        if not (dist.is_initialized() and lost_contact(e)):
            raise
        rank = dist.get_rank()
        fail(f"error: rank {rank} lost contact with the other ranks before training ({why(e)}); no step ran", code=1)
    try:
        with run.attention.active():  # once, around loop and finish: step 0 traces and validation runs under it
            saved = train(run)
    except RuntimeError as e:  # a dead or frozen rank: end now with the last checkpoint, not at the SLURM wall
        if run.world == 1 or not lost_contact(e):
            raise
        run.checkpointer.wait()
        close_metrics(run)
        fail(
            f"error: rank {run.rank} lost contact with the other ranks ({why(e)}); {run.hp.checkpoint_path} holds the "
            f"last save",
            code=1,
        )
    code = 0 if saved else 1  # a failed final save: rank 0 still meets the others at the barrier, then exits 1
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as e:  # every rank has saved and validated: a peer gone now takes nothing from the run
            if not lost_contact(e):
                raise
            message = f"warning: rank {run.rank}: a peer left before the final barrier ({why(e)}); the run had finished"
            print(message, file=sys.stderr, flush=True)
        dist.destroy_process_group()
        if run.device.type == "cpu":  # torch 2.13's gloo can abort in interpreter teardown (~10% of clean runs)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if code:
        sys.exit(code)


def print_on_rank0(message):
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.write(message, file=sys.stdout)  # above the progress bar, not on its line
        sys.stdout.flush()


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


# ----------------------------------------------------------------------------- the loop


@dataclass
class LoopState:
    """What the loop carries from step to step, and finish() reports."""

    step: int = 0
    tokens: int = 0
    lr_frac: float = 0.0
    paused: float = 0.0  # seconds on the clock spent validating and saving, on this rank
    val_token_s: float = 0.0  # what a validation token took, once one validation ran
    last_save: float = 0.0
    last_val: float = 0.0
    stop_reason: str | None = None
    compile_fallback: str | None = None  # the first failing rank's reason
    compile_fallback_ranks: list = dataclasses.field(default_factory=list)
    train_s: float = 0.0
    clock_start_unix: float = 0.0
    startup_s: float | None = None  # from this process's start to the clock's
    progress: float = 0.0  # the schedule's, at the last step
    weights: str = "plain"  # what the final checkpoint holds: plain weights, or the tail EMA's blend


def make_clock(run, budget_s):
    hp, plan = run.hp, run.plan
    # periodic validation stops where the decay starts: the final one measures the end, and the decay runs unbroken
    return Clock(
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
        start_accum=plan.start_accum,
        min_accum=plan.min_accum,
        ramp_frac=plan.ramp_frac,
        progress_by_steps=hp.progress_by == "steps",
    )


def train(run):
    amp = torch.autocast(run.device.type, dtype=torch.bfloat16) if run.hp.autocast == "bf16" else nullcontext()
    clock = make_clock(run, agreed_budget(run))
    log, state = Logger(run, clock), LoopState()
    guard = Guard(run.raw_model, run.optimizers, run.device, run.say)
    ema = TailEMA(run.raw_model, run.hp.tail_ema, run.hp.tail_ema_horizon)
    loss_sum = torch.zeros(2, device=run.device)  # since the last host sync: the steps' losses, the steps that count
    profile = StepProfile(run, clock) if run.hp.profile and run.rank == 0 else None  # --profile; None costs nothing
    gc.collect()
    gc.disable()  # a collection pause on one rank stalls all of them
    t0 = time.perf_counter()  # the clock starts right before the first forward pass, on every rank together
    state.clock_start_unix, state.startup_s = time.time(), process_age_s()
    while True:
        if clock.due(state.step):
            state.stop_reason = host_sync(run, clock, log, state, guard, ema, loss_sum, time.perf_counter() - t0, amp)
            if state.stop_reason:
                break
        if profile:
            profile.begin(state.step)
        step_loss = optimizer_step(run, clock, state, guard, amp)
        if step_loss is None:
            break
        loss_sum += step_loss
        if profile:
            profile.end(state)
    if profile:
        profile.close(state)
    state.train_s = time.perf_counter() - t0
    gc.enable()
    run.loader.close()
    return finish(run, log, clock, amp, state, guard, ema)


def host_sync(run, clock, log, state, guard, ema, loss_sum, elapsed, amp):
    """One all-reduce for the slowest rank's clock, its pauses, any stop signal and a rank whose data is gone; the
    metrics row, the divergence test (a rollback) or the tail EMA's update, the clock's decision, then what it plans
    into the pause: a snapshot, a background save, a validation. Returns the stop reason."""
    data_rank = run.rank + 1 if run.data_gone else 0  # which rank's data is gone, if any: every rank stops with it
    stats = torch.tensor(
        [elapsed, state.paused, state.val_token_s, float(bool(run.stop_signal)), data_rank], device=run.device
    )
    totals = loss_sum.clone()
    if run.world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        dist.all_reduce(totals)  # sums: the row is the mean over every rank's counted steps
    elapsed, paused_all, val_token_s_all, signalled, data_rank = stats.tolist()
    loss_total, counted = totals.tolist()
    if counted > 0:  # 0 only when every rank's batches since the last sync were stand-ins: the data stop below
        loss = loss_total / counted
        if math.isfinite(loss):
            log.row(state.step, state.tokens, elapsed, state.lr_frac, loss)
        if why := guard.diverged(loss):
            step_tokens = run.world * run.plan.micro_batch * run.hp.seq_len * clock.step_accum
            if not guard.roll_back(state.step, why, batch_lr_scale(step_tokens, run.hp, run.device.type)):
                return "diverged"
            ema.reset()
        else:
            ema.update(state.progress, state.step)
    stop_reason = "signal" if signalled else clock.sync(state.step, elapsed, paused_all, val_token_s_all)
    if data_rank:
        run.say(f"stopping: rank {int(data_rank) - 1} has no training data left to read (its stderr says why)")
        stop_reason = "data"
    log.notes()
    if run.rank == 0:
        log.failed_save(wait=False)
    if stop_reason:
        return stop_reason
    loss_sum.zero_()
    pause_start = time.perf_counter()  # snapshots, validation and saves: planned by the clock, not steps
    guard.maybe_snapshot(state.step, state.tokens, elapsed)
    if run.rank == 0 and run.hp.save_every_min > 0 and elapsed - state.last_save >= run.hp.save_every_min * 60:
        log.failed_save()
        run.checkpointer.save(run.raw_model, log.meta(*guard.weights_of(state.step, state.tokens)), background=True)
        state.last_save = elapsed
    if val_batches := clock.validation_batches(elapsed, state.last_val):
        val_start = time.perf_counter()
        val_loss = evaluate(run.raw_model, run.val[:val_batches], run.device, amp)
        log.emit({"step": state.step, "elapsed_s": round(elapsed, 3), "tokens": state.tokens, "val_loss": val_loss})
        val_tokens = sum(y.numel() for _, y in run.val[:val_batches])
        state.val_token_s, state.last_val = (time.perf_counter() - val_start) / val_tokens, elapsed
    state.paused += time.perf_counter() - pause_start
    return None


def optimizer_step(run, clock, state, guard, amp):
    """One optimizer step at the clock's progress and accumulation: accumulate's (loss, count), or None when it stopped
    between micro-steps (its gradients dropped; state.stop_reason says why)."""
    done, accum = clock.begin_step(state.step)
    step_tokens = run.world * run.plan.micro_batch * run.hp.seq_len * accum
    state.lr_frac, momentum = schedule(done, run.hp)
    state.progress = done
    run.raw_model.set_progress(done)  # model.py's untie_at
    set_lrs(run.optimizers, run.hp, state.lr_frac, momentum, step_tokens, run.device.type, guard.lr_scale)
    loss_fn = step_loss_fn(run, done)
    try:
        if state.step == 0 and run.hp.compile:
            step_loss, state.compile_fallback_ranks, state.compile_fallback = first_compiled_step(
                run, accum, amp, loss_fn
            )
        else:
            check_stop = run.world == 1 or (clock.step_s or 0.0) > STOP_CHECK_S
            step_loss = accumulate(run, accum, amp, loss_fn, check_stop=check_stop)
    except DataChanged as e:  # the weights trained so far are saved, with one message
        run.say(f"stopping: {e}")
        step_loss, state.stop_reason = None, "data"
    if step_loss is None:
        run.model.zero_grad(set_to_none=True)
        state.stop_reason = state.stop_reason or "signal"
        return None
    for opt in run.optimizers:
        opt.step()
    # with several ranks kept, not freed: they stay views of DDP's buckets, so the next sync copies nothing into them
    # (2 gloo ranks: 0.89x the step on CPU; one process has no buckets and measured 1.08x: freed; BENCHMARKS.md). Every
    # parameter gets a gradient each step, so the optimizers' `grad is None` skips mean what they meant
    run.model.zero_grad(set_to_none=run.world == 1)
    state.step += 1
    state.tokens += step_tokens
    return step_loss


# steps longer than this look for a stop signal between micro-steps too (one all-reduce of a flag each, on several
# ranks): a stop is then honoured within a micro-step, inside SLURM's 30 s between SIGTERM and SIGKILL
STOP_CHECK_S = 5.0


def accumulate(run, accum, amp, loss_fn, check_stop=False):
    """Forward and backward of one optimizer step's micro-batches under loss_fn (step_loss_fn): (the mean loss, the
    share of the step's batches that count), one tensor (no host sync), or None when check_stop found a stop signal
    between micro-steps (agreed across ranks). A stand-in batch (next_batch: weight 0) counts in neither."""
    step_loss = torch.zeros(2, device=run.device)
    for micro in range(accum):
        if check_stop and micro and stop_agreed(run):
            return None
        (x, y), weight = next_batch(run)
        # gradients are all-reduced once per optimizer step, on the last micro-step
        with run.model.no_sync() if run.world > 1 and micro < accum - 1 else nullcontext():
            with amp:
                _, loss = run.model(x, y, loss_fn=loss_fn)
            (loss * (weight / accum)).backward()
        step_loss += torch.stack([loss.detach().float(), loss.new_ones((), dtype=torch.float32)]) * (weight / accum)
    return step_loss


def next_batch(run):
    """(the next micro-batch, its loss weight). Once this rank's data is gone (DataChanged) in a multi-rank run, a
    stand-in batch of the same shape with weight 0: the rank keeps meeting the others in the gradient all-reduce
    until the next host sync stops every rank together ("data"), instead of leaving them in a collective."""
    if run.data_gone is None:
        try:
            return next(run.loader), 1.0
        except DataChanged as e:
            if run.world == 1:
                raise
            run.data_gone = str(e)
            print(f"rank {run.rank}: {e} Stopping every rank at the next host sync.", file=sys.stderr, flush=True)
    stand_in = torch.zeros(run.plan.micro_batch, run.hp.seq_len, dtype=torch.long, device=run.device)
    return (stand_in, stand_in), 0.0


def stop_agreed(run):
    if run.world == 1:
        return bool(run.stop_signal)
    flag = torch.tensor([float(bool(run.stop_signal))], device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def first_compiled_step(run, accum, amp, loss_fn):
    """Step 0, which compiles every graph training uses: first in a trial micro-step (compiled_trial) that takes no
    collective, so ranks can agree on what failed before any gradient all-reduce. When it fails inside the attention
    backend on any rank, every rank moves down the backends (kernels.next_attention, agreed) and compiles again, each
    rank that failed saying so on its stderr and rank 0 once for all; elsewhere (a Triton or ptxas that does not know
    the GPU; on CPU, no working C++ compiler) the rank runs step 0 and the rest of the run eagerly, and the clock
    measures its step time from step 1 on. Every rank learns which ranks fell back (one all-reduce; the reason
    travels only on failure), since all ranks wait for an eager one: one line names them. Returns (accumulate's loss
    and count, the ranks that run eagerly, the first one's reason)."""
    counts = compile_counts()  # graphs compiled under a backend left behind are not the run's
    why, in_attention = compiled_trial(run, amp, loss_fn)
    while (failed := failing_ranks(why if in_attention else None, run.device, run.world, run.rank))[0]:
        if (rest := next_attention(run.attention)) is None:
            break
        if in_attention:
            print(f"rank {run.rank}: step 0 failed inside attention {run.attention.name} ({why})", file=sys.stderr)
        rest = agreed_attention(rest, run.device, run.world)
        where = "" if run.world == 1 else f" on {rank_span(failed[0])} of {run.world}"
        run.say(
            f"warning: step 0 failed inside attention {run.attention.name}{where} ({failed[1]}); every rank compiles "
            f"again under {rest.label}, op {rest.op}"
        )
        for note in rest.notes:
            run.say(note)
        forget_compiles(counts)
        run.attention = switch_attention(rest)
        why, in_attention = compiled_trial(run, amp, loss_fn)
    if why is not None:
        torch.compiler.set_stance("force_eager")
    step_loss = accumulate(run, accum, amp, loss_fn)
    if why is None:  # after step 0 no recompile may stall the clock: a guard miss raises, and EagerRuns runs it eagerly
        torch.compiler.set_stance("fail_on_recompile")
    eager, first_why = failing_ranks(why, run.device, run.world, run.rank)
    if eager:
        where = "" if run.world == 1 else f" on {rank_span(eager)} of {run.world}"
        wait = "" if run.world == 1 else " there, and every rank waits for them"
        run.say(f"warning: compiling failed at the first step{where} ({first_why}); training goes on eagerly{wait}")
    return step_loss, eager, first_why


def compiled_trial(run, amp, loss_fn):
    """One compiled micro-step of step 0's shape on a stand-in batch (every graph compiles in it: backward graphs in
    the first forward, launch.py), its gradients dropped, under DDP's no_sync: no collective. Returns (None, False),
    or where compiling or running it failed (a lost peer is raised) its reason and whether it failed inside
    attention (kernels.failed_in_attention)."""
    x = torch.zeros(run.plan.micro_batch, run.hp.seq_len, dtype=torch.long, device=run.device)
    try:
        with run.model.no_sync() if run.world > 1 else nullcontext():
            with amp:
                _, loss = run.model(x, x, loss_fn=loss_fn)
            loss.backward()
        return None, False
    except Exception as e:
        if isinstance(e, dist.DistError):
            raise
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}", failed_in_attention(e)
    finally:
        run.model.zero_grad(set_to_none=True)


def finish(run, log, clock, amp, state, guard, ema):
    """After the clock: save first, then validate (a slow eval can never cost the checkpoint), then the summary.
    A run that diverged after its last rollback saves its last trusted snapshot, and exits 0; else the weights take
    in the tail EMA's blend, if it is on and its window opened (what the checkpoint and the validation score).
    The labels (weights, weights_step, the log's lines) say what the checkpoint on disk holds, on every path."""
    hp, device, train_s = run.hp, run.device, state.train_s
    diverged = state.stop_reason == "diverged"
    if diverged:
        run.say(f"stopping: the loss diverged after {len(guard.rollbacks)} rollback(s)")
    else:
        ema.update(state.progress, state.step)
        state.weights = ema.blend_in()
    if guard.restore_for_the_final_save(state.step, diverged=diverged):
        state.weights = "plain"  # the trusted snapshot's weights, whatever was blended before
    if state.weights != "plain":
        run.say(f"final weights: {state.weights}")
    step, tokens = guard.weights_of(state.step, state.tokens)  # what the checkpoint and the final validation hold
    saved = True
    if run.rank == 0:
        log.failed_save()
        try:
            run.checkpointer.save(run.raw_model, log.meta(step, tokens, state.weights), background=False)
            run.say(f"saved {hp.checkpoint_path} at step {step} ({state.stop_reason}) after {train_s:.1f}s")
        except Exception as e:  # any failure: rank 0 still validates with the others and meets them at the barrier
            held = run.checkpointer.on_disk
            kept = f"step {held['step']}, the last save that succeeded" if held else "nothing: no save succeeded"
            why = str(e).rstrip(".") if isinstance(e, CheckpointError) else repr(e)[:300]
            run.say(f"error: the final save failed: {why}; {hp.checkpoint_path} holds {kept}")
            saved = False
    val_batches = clock.final_validation_batches()
    log.notes()
    val_loss = evaluate(run.raw_model, run.val[:val_batches], device, amp)
    log.emit({"step": step, "elapsed_s": round(train_s, 3), "tokens": tokens, "val_loss": val_loss})
    summary = {**summary_row(run, clock, state, val_loss, val_batches), "rollbacks": guard.rollbacks}
    summary["weights_step"] = step  # below "steps" when the run ends on restored weights
    if not saved:  # the checkpoint on disk is an earlier save's (or none), not the weights validated
        held = run.checkpointer.on_disk or {}
        summary["weights"], summary["weights_step"] = held.get("weights"), held.get("step")
    log.emit(summary)
    log.close(train_s)
    run.say(human_summary(summary, hp))
    return saved


if __name__ == "__main__":
    main()

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

import argparse
import ctypes
import dataclasses
import gc
import json
import math
import operator
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from model import GPTConfig
from checkpoint import CheckpointError
from clock import Clock
from plan import AUTO_EFFICIENCY, MIN_TOKENS_PER_STEP, TOKENS_PER_PARAM, peak_flops
from data import DataChanged
from launch import build_plan, fail, launch, resolve


def flag(default, help, kind=None, choices=None, at_least=None, above=None, below=None, at_most=None):
    """A hyperparameter, its --help line and the values it may take (check_flags): choices, or a finite number within
    the bounds given. kind converts a flag whose default is "auto"."""
    bounds = {"at least": at_least, "above": above, "below": below, "at most": at_most}
    meta = {
        "help": help,
        "kind": kind,
        "choices": choices,
        "bounds": {k: v for k, v in bounds.items() if v is not None},
    }
    return field(default=default, metadata=meta)


POSITIVE = {"at_least": 1}  # counts: sequences, steps, layers
FRACTION = {"at_least": 0.0, "at_most": 1.0}
LR = {"at_least": 0.0}  # finite; huge ones stay allowed: a diverging run is an experiment (tests make one)


@dataclass(frozen=True)
class Hyperparameters:
    """The flags. As parsed, a flag not given holds "auto"; launch.resolve() returns them with every "auto" made
    concrete in the annotated type (None: the plan decides), once, for the run and for --dry_run alike."""

    # --- the organizers' flag names, kept verbatim ---
    data_dir: str | None = flag("auto", "chunk_*.bin token folder; auto: /home/data if present, else synthetic data")
    checkpoint_path: str = flag("checkpoint.pt", "written at start, every --save_every_min, on SIGTERM and at the end")
    seq_len: int = flag(1024, "training window in tokens", **POSITIVE)
    vocab_size: int = flag(
        "auto", "auto: 32000 for token files, 1024 for the synthetic data", int, at_least=2, at_most=65536
    )
    n_layer: int | None = flag(
        "auto", "shape flag; auto: from --model (given shape flags win, see --shape_flags)", int, **POSITIVE
    )
    n_head: int | None = flag("auto", "shape flag; auto: from --model", int, **POSITIVE)
    n_embd: int | None = flag("auto", "shape flag; auto: from --model", int, **POSITIVE)
    batch_size: int = flag(8, "the floor of the micro-batch (sequences per device per forward)", **POSITIVE)
    grad_accum_steps: int | None = flag(
        "auto", "derived by the plan from tokens per step; a given value is ignored", int, **POSITIVE
    )
    max_steps: int = flag(1_000_000, "never exceeded; tokens per step grow so the budget fits in 90% of it", **POSITIVE)
    time_limit_min: float = flag(10.0, "the training budget in minutes, from the first forward pass", above=0.0)
    # --- the run plan (plan.py) ---
    model: str = flag("auto", "a plan.LADDER name; auto: the largest trained --tokens_per_param tokens per param")
    shape_flags: str = flag(
        "win", "win: --n_layer/--n_head/--n_embd override --model; ignore: --model decides", choices=("win", "ignore")
    )
    tokens_per_param: float = flag(
        "auto", f"what --model auto wants; auto: per device {TOKENS_PER_PARAM}", float, above=0.0
    )
    auto_efficiency: float = flag(
        "auto", f"step speed / matmul rate; auto: per device {AUTO_EFFICIENCY}", float, above=0.0, at_most=1.0
    )
    batch_tokens: int | None = flag(
        "auto", "global tokens per step; auto: the recipe's minimum, or more (--max_steps)", int, **POSITIVE
    )
    micro_batch: int | None = flag(
        "auto", "sequences per device per forward; auto: as many as memory allows", int, **POSITIVE
    )
    ramp_frac: float = flag(
        0.0,
        "when --max_steps forces more tokens per step than the recipe's: start at the recipe's and grow them linearly "
        "over this fraction of the budget (all steps still fit in the cap); 0: the forced batch throughout",
        at_least=0.0,
        below=1.0,
    )
    dry_run: bool = flag(False, "print the plan and exit before any forward pass")
    world_size: int = flag("auto", "with --dry_run: plan for this many devices; auto: this launch's", int, **POSITIVE)
    peak_tflops: float | None = flag(
        "auto", "bf16 peak per device, for MFU (and the rate a dry run plans with)", float, above=0.0
    )
    device_memory_gib: float | None = flag(
        "auto", "per-device memory to plan with; auto: this device's", float, above=0.0
    )
    # --- data and evaluation ---
    metrics_path: str = flag("auto", "JSON-lines metrics; auto: metrics.jsonl beside the checkpoint")
    val_file: str | None = flag("auto", "validation token file; auto: the last --val_tokens of the last data file")
    val_tokens: int = flag(
        1_048_576, "size of the held-out validation range (the same tokens on every run)", at_least=0, at_most=1 << 27
    )
    val_eval_tokens: int = flag("auto", "validation tokens scored; auto: all on CUDA, 65536 on CPU", int, **POSITIVE)
    val_every_min: float = flag(
        0.0, "periodic validation until the decay, planned into the budget; 0: final only", at_least=0.0
    )
    save_every_min: float = flag(2.5, "background checkpoint cadence; 0: only at start and end", at_least=0.0)
    doc_aligned: bool = flag(False, "start every window at a BOS token (needs BOS-marked data)")
    # --- schedule and optimizer ---
    schedule: str = flag(
        "wsd", "wsd (warmup, stable, linear decay) or cosine (the starter's, for baselines)", choices=("wsd", "cosine")
    )
    progress_by: str = flag(
        "clock", "clock: elapsed / budget; steps: step / max_steps (the starter's way)", choices=("clock", "steps")
    )
    warmup_frac: float = flag(0.0, "fraction of the run in linear LR warmup (Muon needs none)", at_least=0.0, below=1.0)
    decay_frac: float = flag(0.4, "WSD: fraction of the run in the final linear decay", above=0.0, at_most=1.0)
    min_lr_frac: float = flag(0.0, "the LR floor the decay ends at, as a fraction of each group's LR", **FRACTION)
    optimizer: str = flag(
        "muon", "muon: Muon for hidden matrices + AdamW; adamw: AdamW for everything", choices=("muon", "adamw")
    )
    muon_lr: float = flag(0.05, "Muon LR of the hidden matrices", **LR)
    adamw_lr: float = flag(3e-3, "AdamW LR of the hidden matrices with --optimizer adamw", **LR)
    embed_lr: float = flag(0.6, "AdamW LR of the embedding tables", **LR)
    head_lr: float = flag(0.008, "AdamW LR of the output head (and of a tied embedding)", **LR)
    scalar_lr: float = flag(0.04, "AdamW LR of gains and scalars", **LR)
    lr_rule: str = flag(
        "sqrt",
        "sqrt: every LR x sqrt(tokens per step / the recipe's minimum) when the batch is larger (BENCHMARKS.md, "
        "the step cap); none: the LRs as given",
        choices=("none", "sqrt"),
    )
    weight_decay: float = flag(0.0, "decoupled weight decay of matrices and tables", **LR)
    muon_momentum_start: float = flag(
        0.85, "Muon momentum at the start (early gradients are noisy)", at_least=0.0, below=1.0
    )
    muon_momentum: float = flag(0.95, "Muon momentum after --momentum_warmup_frac", at_least=0.0, below=1.0)
    momentum_warmup_frac: float = flag(0.15, "fraction of the run over which Muon momentum warms up", **FRACTION)
    # --- device and runtime ---
    device: str = flag("auto", "auto (CUDA if present), cpu or cuda", choices=("auto", "cpu", "cuda"))
    compile: bool = flag("auto", "compile each transformer block; auto: on CUDA only", bool)
    autocast: str = flag("auto", "bf16 or none; auto: bf16 on CUDA, none on CPU", choices=("auto", "bf16", "none"))
    grad_reduce: str = flag(
        "bf16", "dtype of the gradient all-reduce across ranks: bf16 (half the bytes) or fp32", choices=("bf16", "fp32")
    )
    collective_timeout_min: float = flag(
        5.0, "a rank silent this long in a collective ends the job (> compile skew)", above=0.0
    )
    slurm_reserve_s: float = flag(
        60.0, "under SLURM, seconds kept after training for the final save and exit", at_least=0.0
    )
    seed: int = flag(0, "seed of the weights and of the data order", at_least=0, below=2**32)
    log_every_s: float = flag(
        1.0, "host-sync cadence: clock check, loss read, stop decision, metrics row", at_least=0.0
    )


def parse_args(argv=None):
    """(Hyperparameters, model.py switches given, unknown flags). Flags come from the dataclass, plus one per
    model.py switch (default: model.py's own)."""
    # no prefix matching: an unknown --warmup must be ignored, not read as --warmup_frac
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    for f in dataclasses.fields(Hyperparameters):
        kind, help_text = (
            f.metadata["kind"] or (f.type if f.type in (int, float, bool) else str),
            f"{f.metadata['help']} (default: {f.default})".replace("%", "%%"),
        )
        if kind is bool:
            parser.add_argument(f"--{f.name}", default=f.default, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        convert = (lambda k: lambda s: s if s == "auto" else k(s))(kind) if f.default == "auto" else kind
        parser.add_argument(f"--{f.name}", type=convert, default=f.default, help=help_text)
    ours = {f.name for f in dataclasses.fields(Hyperparameters)}
    switches = [f for f in dataclasses.fields(GPTConfig) if f.name not in ours]
    for f in switches:
        kind = {bool: None}.get(f.type, f.type)
        extra = {"action": argparse.BooleanOptionalAction} if f.type is bool else {"type": kind}
        parser.add_argument(f"--{f.name}", default=None, help=f"model.py switch (default: {f.default})", **extra)
    args, unknown = parser.parse_known_args(argv)
    args = vars(args)
    model_switches = {f.name: value for f in switches if (value := args.pop(f.name)) is not None}
    return Hyperparameters(**args), model_switches, unknown


BOUND_TESTS = {"at least": operator.ge, "above": operator.gt, "below": operator.lt, "at most": operator.le}


def check_flags(hp):
    """Flag values a user can get wrong, as one sentence each; the same on every rank, so no collective."""
    for f in dataclasses.fields(hp):
        value, choices, bounds = getattr(hp, f.name), f.metadata["choices"], f.metadata["bounds"]
        if choices and value not in choices:
            raise ValueError(f"--{f.name} must be one of {', '.join(choices)}, got {value!r}")
        if not bounds or value == "auto":
            continue
        if not math.isfinite(value):
            raise ValueError(f"--{f.name} must be a finite number, got {value}")
        for words, bound in bounds.items():
            if not BOUND_TESTS[words](value, bound):
                raise ValueError(f"--{f.name} must be {words} {bound}, got {value}")
    if hp.schedule == "wsd" and hp.warmup_frac + hp.decay_frac > 1.0:
        raise ValueError(
            f"--warmup_frac {hp.warmup_frac} leaves no room for the decay: with wsd it must be at most 1 - --decay_frac"
        )
    if hp.device == "cuda" and not torch.cuda.is_available() and not hp.dry_run:
        raise ValueError("--device cuda was given but no CUDA device is visible")


# ----------------------------------------------------------------------------- schedule


def schedule(progress_frac, hp):
    """(lr_frac, muon momentum) at progress in [0, 1]: warmup, stable, linear decay to the floor."""
    p = min(max(progress_frac, 0.0), 1.0)
    floor = hp.min_lr_frac
    if hp.warmup_frac > 0 and p < hp.warmup_frac:
        lr_frac = p / hp.warmup_frac
    elif hp.schedule == "cosine":
        lr_frac = floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * (p - hp.warmup_frac) / (1 - hp.warmup_frac)))
    elif p < 1.0 - hp.decay_frac:
        lr_frac = 1.0
    else:
        lr_frac = floor + (1.0 - floor) * (1.0 - p) / hp.decay_frac
    warm = min(p / hp.momentum_warmup_frac, 1.0) if hp.momentum_warmup_frac > 0 else 1.0
    momentum = hp.muon_momentum_start + warm * (hp.muon_momentum - hp.muon_momentum_start)
    return min(lr_frac, 1.0), momentum


# ----------------------------------------------------------------------------- main


# every way a job is told to stop: preemption and torchrun (TERM), Ctrl-C (INT), a dropped ssh session (HUP),
# `sbatch --signal` (USR1, USR2), a quit key (QUIT), a CPU-time limit (XCPU)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")


def main(argv=None):
    stop_signal = []  # from here on: finish the current step (or micro-step), save, validate, exit 0
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), lambda sig, frame: stop_signal.append(sig))
    stop_with_the_launcher()
    hp, model_switches, unknown = parse_args(argv)
    say = print_on_rank0
    if unknown:
        say(f"ignoring unknown flags: {' '.join(unknown)}")
    try:  # flag errors are the same on every rank: each exits on its own
        check_flags(hp)
    except ValueError as e:
        fail(f"error: {e}")
    if hp.dry_run:
        dry_run(hp, model_switches, say)
        return
    run = launch(hp, model_switches, stop_signal, say)
    try:
        train(run)
    except RuntimeError as e:  # a dead or frozen rank: end now with the last checkpoint, not at the SLURM wall
        lost = isinstance(e, dist.DistError) or any(w in str(e).lower() for w in ("timed out", "connection"))
        if run.world == 1 or not lost:
            raise
        run.checkpointer.wait()
        fail(
            f"error: rank {run.rank} lost contact with the other ranks ({str(e).splitlines()[0][:200]}); "
            f"{run.hp.checkpoint_path} holds the last save",
            code=1,
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if run.device.type == "cpu":  # torch 2.13's gloo can abort in interpreter teardown (~10% of clean runs)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def stop_with_the_launcher():
    """Under torchrun, a worker is sent SIGTERM when its launcher dies: torchrun forwards TERM, INT, HUP and QUIT,
    but a signal it does not handle (USR1 from `sbatch --signal`) kills it outright and would orphan the worker."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the launcher's own forwarding is all there is
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def print_on_rank0(message):
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.write(message, file=sys.stdout)  # above the progress bar, not on its line
        sys.stdout.flush()


def dry_run(hp, model_switches, say):
    """The plan, printed: for this machine, or with --peak_tflops for a device that is not here."""
    hp = resolve(hp, int(os.environ.get("WORLD_SIZE", 1)))
    try:
        plan = build_plan(hp, model_switches, torch.device(hp.device), hp.world_size, hp.time_limit_min * 60, say)
    except ValueError as e:
        fail(f"error: {e}")
    say(plan.line())
    say(json.dumps(dataclasses.asdict(plan)))


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
                _, loss = model(x.to(device), y.to(device), return_logits=False)
            total += loss.float() * y.numel()  # token-weighted: the last batch may be smaller
            count += y.numel()
    model.train()
    stats = torch.stack([total, torch.tensor(float(count), device=device)])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


def batch_lr_scale(step_tokens, hp, kind):
    """The LR multiplier of a step of step_tokens: 1, or with --lr_rule sqrt the square-root rule for adaptive
    optimizers (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms") against the
    recipe's minimum batch, never below 1."""
    if hp.lr_rule == "none":
        return 1.0
    return math.sqrt(max(step_tokens / MIN_TOKENS_PER_STEP[kind], 1.0))


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
    compile_fallback: str | None = None
    train_s: float = 0.0
    clock_start_unix: float = 0.0


def make_clock(run):
    hp, plan = run.hp, run.plan
    # periodic validation stops where the decay starts: the final one measures the end, and the decay runs unbroken
    return Clock(
        run.budget_s,
        hp.max_steps,
        plan.grad_accum_steps,
        hp.log_every_s,
        may_replan=hp.batch_tokens is None,
        planned_step_s=plan.step_s,
        micro_tokens=plan.micro_batch * hp.seq_len,
        val_every_s=hp.val_every_min * 60,
        val_until_s=run.budget_s * (1 - hp.decay_frac),
        val_batches=len(run.val),
        val_tokens=sum(y.numel() for _, y in run.val),
        start_accum=plan.start_accum,
        ramp_frac=plan.ramp_frac,
        progress_by_steps=hp.progress_by == "steps",
    )


def train(run):
    amp = torch.autocast(run.device.type, dtype=torch.bfloat16) if run.hp.autocast == "bf16" else nullcontext()
    clock = make_clock(run)
    log, state = Logger(run, clock), LoopState()
    loss_sum = torch.zeros((), device=run.device)
    gc.collect()
    gc.disable()  # a collection pause on one rank stalls all of them
    t0 = time.perf_counter()  # the clock starts right before the first forward pass, on every rank together
    state.clock_start_unix = time.time()
    while True:
        if clock.due(state.step):
            state.stop_reason = host_sync(run, clock, log, state, loss_sum, time.perf_counter() - t0, amp)
            if state.stop_reason:
                break
        step_loss = optimizer_step(run, clock, state, amp)
        if step_loss is None:
            break
        loss_sum += step_loss
    state.train_s = time.perf_counter() - t0
    gc.enable()
    run.loader.close()
    finish(run, log, clock, amp, state)


def host_sync(run, clock, log, state, loss_sum, elapsed, amp):
    """One all-reduce for the slowest rank's clock, its pauses and any stop signal; the metrics row, the clock's
    decision, then what the clock plans into the pause: a background save, a validation. Returns the stop reason."""
    stats = torch.tensor([elapsed, state.paused, state.val_token_s, float(bool(run.stop_signal))], device=run.device)
    mean_loss = loss_sum / max(state.step - clock.prev_step, 1)
    if run.world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    elapsed, paused_all, val_token_s_all, signalled = stats.tolist()
    if state.step > clock.prev_step:
        if not math.isfinite(mean_loss.item()):
            return "non-finite loss"
        log.row(state.step, state.tokens, elapsed, state.lr_frac, mean_loss.item())
    stop_reason = "signal" if signalled else clock.sync(state.step, elapsed, paused_all, val_token_s_all)
    log.notes()
    if run.rank == 0:
        log.failed_save(wait=False)
    if stop_reason:
        return stop_reason
    loss_sum.zero_()
    pause_start = time.perf_counter()  # validation and saves: planned by the clock, not steps
    if run.rank == 0 and run.hp.save_every_min > 0 and elapsed - state.last_save >= run.hp.save_every_min * 60:
        log.failed_save()
        run.checkpointer.save(run.raw_model, log.meta(state.step, state.tokens), background=True)
        state.last_save = elapsed
    if val_batches := clock.validation_batches(elapsed, state.last_val):
        val_start = time.perf_counter()
        val_loss = evaluate(run.raw_model, run.val[:val_batches], run.device, amp)
        log.emit({"step": state.step, "elapsed_s": round(elapsed, 3), "tokens": state.tokens, "val_loss": val_loss})
        val_tokens = sum(y.numel() for _, y in run.val[:val_batches])
        state.val_token_s, state.last_val = (time.perf_counter() - val_start) / val_tokens, elapsed
    state.paused += time.perf_counter() - pause_start
    return None


def optimizer_step(run, clock, state, amp):
    """One optimizer step at the clock's progress and accumulation: its mean loss, or None when it stopped between
    micro-steps (its gradients dropped; state.stop_reason says why)."""
    done, accum = clock.begin_step(state.step)
    step_tokens = run.world * run.plan.micro_batch * run.hp.seq_len * accum
    state.lr_frac, momentum = schedule(done, run.hp)
    run.raw_model.set_progress(done)  # model.py's untie_at
    lr_scale = batch_lr_scale(step_tokens, run.hp, run.device.type)
    for opt in run.optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * state.lr_frac * lr_scale
            if "momentum" in group:
                group["momentum"] = momentum
    try:
        if state.step == 0 and run.hp.compile:
            step_loss, state.compile_fallback = first_compiled_step(run, accum, amp)
        else:
            check_stop = run.world == 1 or (clock.step_s or 0.0) > STOP_CHECK_S
            step_loss = accumulate(run, accum, amp, check_stop=check_stop)
    except DataChanged as e:  # the weights trained so far are saved, with one message
        run.say(f"stopping: {e}")
        step_loss, state.stop_reason = None, "data"
    if step_loss is None:
        run.model.zero_grad(set_to_none=True)
        state.stop_reason = state.stop_reason or "signal"
        return None
    for opt in run.optimizers:
        opt.step()
    run.model.zero_grad(set_to_none=True)
    state.step += 1
    state.tokens += step_tokens
    return step_loss


# after step 0 a graph that training did not compile then runs eagerly: no recompile can stall the clock or hit
# dynamo's recompile limit (tests set "fail_on_recompile" to prove that none is asked for)
RECOMPILE_STANCE = "eager_on_recompile"


# steps longer than this look for a stop signal between micro-steps too (one all-reduce of a flag each, on several
# ranks): a stop is then honoured within a micro-step, inside SLURM's 30 s between SIGTERM and SIGKILL
STOP_CHECK_S = 5.0


def accumulate(run, accum, amp, check_stop=False):
    """Forward and backward of one optimizer step's micro-batches; the mean loss, as a tensor (no host sync), or None
    when check_stop found a stop signal between micro-steps (agreed across ranks)."""
    step_loss = torch.zeros((), device=run.device)
    for micro in range(accum):
        if check_stop and micro and stop_agreed(run):
            return None
        x, y = next(run.loader)
        # gradients are all-reduced once per optimizer step, on the last micro-step
        with run.model.no_sync() if run.world > 1 and micro < accum - 1 else nullcontext():
            with amp:
                _, loss = run.model(x, y, return_logits=False)
            (loss / accum).backward()
        step_loss += loss.detach() / accum
    return step_loss


def stop_agreed(run):
    if run.world == 1:
        return bool(run.stop_signal)
    flag = torch.tensor([float(bool(run.stop_signal))], device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def first_compiled_step(run, accum, amp):
    """Step 0, which compiles every graph training uses: (mean loss, None), or (mean loss, why) when compiling
    failed (a Triton or ptxas that does not know the GPU; on CPU, no working C++ compiler). Then the attempt is
    lost, not the slot: the step runs again eagerly, and so does the rest of the run, whose step time the clock
    measures from step 1 on. Backward graphs are compiled in the first forward (launch.py), so a failure comes
    before DDP's reducer expects a backward."""
    try:
        step_loss = accumulate(run, accum, amp)
    except Exception as e:
        if isinstance(e, dist.DistError):
            raise
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        run.say(f"warning: compiling failed at the first step ({why}); training goes on eagerly")
        torch.compiler.set_stance("force_eager")
        run.model.zero_grad(set_to_none=True)
        return accumulate(run, accum, amp), why
    torch.compiler.set_stance(RECOMPILE_STANCE)
    return step_loss, None


def finish(run, log, clock, amp, state):
    """After the clock: save first, then validate (a slow eval can never cost the checkpoint), then the summary.
    A non-finite loss saves nothing: the last checkpoint keeps the last finite weights, and the exit code is 1."""
    hp, device, step, tokens, train_s = run.hp, run.device, state.step, state.tokens, state.train_s
    if state.stop_reason == "non-finite loss":
        run.say(
            f"stopping: non-finite training loss at step {step}; {hp.checkpoint_path} keeps the last finite weights"
        )
        log.emit({"step": step, "elapsed_s": round(train_s, 3), "error": "non-finite loss"})
        run.checkpointer.wait()
        sys.exit(1)
    saved = True
    if run.rank == 0:
        log.failed_save()
        try:
            run.checkpointer.save(run.raw_model, log.meta(step, tokens), background=False)
            run.say(f"saved {hp.checkpoint_path} at step {step} ({state.stop_reason}) after {train_s:.1f}s")
        except CheckpointError as e:
            run.say(f"error: the final save failed: {e}")
            saved = False
    val_batches = clock.final_validation_batches()
    log.notes()
    val_loss = evaluate(run.raw_model, run.val[:val_batches], device, amp)
    log.emit({"step": step, "elapsed_s": round(train_s, 3), "tokens": tokens, "val_loss": val_loss})
    summary = summary_row(run, clock, state, val_loss, val_batches)
    log.emit(summary)
    run.say(json.dumps(summary))
    log.close()
    if not saved:
        sys.exit(1)


def summary_row(run, clock, state, val_loss, val_batches):
    """The final metrics row: what happened, beside the plan; clock start and bad windows agreed over ranks."""
    first_clock = torch.tensor([state.clock_start_unix], device=run.device, dtype=torch.float64)
    bad_windows = torch.tensor([run.loader.bad_windows], device=run.device)
    if run.world > 1:
        dist.all_reduce(first_clock, op=dist.ReduceOp.MIN)
        dist.all_reduce(bad_windows)
    return {
        "summary": True,
        "steps": state.step,
        "tokens": state.tokens,
        "train_s": round(state.train_s, 3),
        "tokens_per_s": round(state.tokens / max(state.train_s, 1e-9)),
        "compile_s": round(clock.compile_s, 3),
        "compiled_graphs": compiled_graphs() if run.hp.compile else 0,
        "planned_graphs": run.raw_model.compiled_graphs(run.plan.micro_batch * run.hp.seq_len, run.device.type)
        if run.hp.compile
        else 0,
        "compile_fallback": state.compile_fallback,
        "final_lr_frac": state.lr_frac,
        "stop_reason": state.stop_reason,
        "val_loss": val_loss,
        "val_batches": val_batches,
        "params": run.raw_model.num_params(),
        "world_size": run.world,
        "budget_s": round(run.budget_s, 3),
        "time_limit_min": run.hp.time_limit_min,
        "grad_accum_steps": clock.accum,
        "bad_windows": bad_windows.item(),
        "step0_saved_unix": run.step0_saved_unix,
        "clock_start_unix": first_clock.item(),
        "plan": dataclasses.asdict(run.plan),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(run.device) / 2**30, 2)
        if run.device.type == "cuda"
        else None,
    }


def compiled_graphs():
    """Graphs torch.compile made in this process (dynamo's own count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class Logger:
    """Metrics rows (rank 0's file), the progress bar, the clock's notes and failed background saves."""

    def __init__(self, run, clock):
        self.run, self.clock = run, clock
        self.peak = (run.hp.peak_tflops * 1e12 if run.hp.peak_tflops else peak_flops(run.device)) * run.world
        self.bar = tqdm(total=round(run.budget_s), unit="s", disable=run.rank != 0, dynamic_ncols=True, mininterval=1.0)
        self.prev_tokens = 0

    def emit(self, row):
        if self.run.metrics is None:
            return
        try:
            self.run.metrics.write(json.dumps(row) + "\n")
            self.run.metrics.flush()
        except OSError as e:  # a full disk must not end training: the checkpoint matters, the log does not
            self.run.say(f"warning: cannot write {self.run.hp.metrics_path} ({e.strerror}); metrics rows stop here")
            self.run.metrics = None

    def row(self, step, tokens, elapsed, lr_frac, train_loss):
        """The training row of a sync."""
        tok_s = (tokens - self.prev_tokens) / max(elapsed - self.clock.prev_elapsed, 1e-9)
        self.prev_tokens = tokens
        row = {
            "step": step,
            "elapsed_s": round(elapsed, 3),
            "lr_frac": lr_frac,
            "train_loss": train_loss,
            "tokens": tokens,
            "tokens_per_step": self.run.world * self.run.plan.micro_batch * self.run.hp.seq_len * self.clock.step_accum,
            "tokens_per_s": round(tok_s),
        }
        if self.peak:
            row["mfu"] = round(tok_s * self.run.plan.flops_per_token / self.peak, 4)
        self.emit(row)
        self.bar.set_postfix(
            step=step, loss=f"{train_loss:.3f}", lr=f"{lr_frac:.2f}", tok_s=f"{tok_s:.3g}", refresh=False
        )
        self.bar.update(min(round(elapsed), self.bar.total) - self.bar.n)

    def notes(self):
        for note in self.clock.notes:
            self.run.say(note)
        self.clock.notes.clear()

    def meta(self, step, tokens):
        return {"config": self.run.config, "step": step, "tokens": tokens}

    def failed_save(self, wait=True):
        """A background save that failed is said once; training goes on and the previous checkpoint stays."""
        error = self.run.checkpointer.wait() if wait else self.run.checkpointer.poll()
        if error:
            self.run.say(f"warning: a background checkpoint save failed ({error}); training goes on")

    def close(self):
        self.bar.close()
        if self.run.metrics is not None:
            self.run.metrics.close()


if __name__ == "__main__":
    main()

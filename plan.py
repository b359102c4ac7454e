"""The run plan: everything decided before the clock, and the clock arithmetic the training loop uses.

A plan is resolved once from the budget, --max_steps, the world size and the device's speed (measured, or
stated for --dry_run): the model shape, global tokens per optimizer step, micro-batch and accumulation, and
the forecast step time, steps and tokens. train.py logs it once, stores it in the checkpoint config and puts
it next to what happened in the final summary.

Rules (all per device kind, tables below):
- Throughput forecast: matmul_rate x efficiency x world_size / flops_per_token tokens per second.
- Tokens per step: the recipe's minimum, raised so that the whole budget fits in STEP_HEADROOM x max_steps
  steps (the clock, not the step cap, ends a normal run); an explicit --batch_tokens fixes it instead.
- Micro-batch: as many sequences as one device's memory and MAX_MICRO_TOKENS allow, at least --batch_size;
  accumulation covers the rest of the step.
- --model auto: the largest ladder shape that fits in memory and still trains TOKENS_PER_PARAM tokens per
  block parameter (the blocks' ~12 x n_layer x n_embd^2 weights; the 32K embeddings and head are fixed by
  the vocabulary), counting the tokens this plan will actually train.
"""

import dataclasses
import math
import os
import time
from functools import lru_cache

import torch
import torch.distributed as dist

from model import get_model

LADDER = [  # name, n_layer, n_head, n_embd: depth and width grow together, head size 64..128
    ("l2w64", 2, 2, 64),
    ("l4w128", 4, 4, 128),
    ("l6w256", 6, 4, 256),
    ("l8w384", 8, 6, 384),
    ("l12w768", 12, 6, 768),
    ("l16w1024", 16, 8, 1024),
    ("l20w1280", 20, 10, 1280),
    ("l24w1536", 24, 12, 1536),
    ("l28w2048", 28, 16, 2048),
]
# CPU: calibrated on the bench corpus (BENCHMARKS.md: the 2/5/10-minute ladders for the ratio and efficiency,
# the 5-minute tokens-per-step sweep for the minimum). CUDA: assumed until a GPU ladder measures them:
# Chinchilla's 20 tokens/param at 0.4 of the bf16 matmul rate, modded-nanogpt's ~0.5M tokens a step.
AUTO_EFFICIENCY = {"cuda": 0.4, "cpu": 0.2}
TOKENS_PER_PARAM = {"cuda": 20.0, "cpu": 0.05}
MIN_TOKENS_PER_STEP = {"cuda": 524288, "cpu": 2048}
# GEMMs with this many rows already run at full speed; more would only cost activation memory
MAX_MICRO_TOKENS = {"cuda": 32768, "cpu": 8192}
STEP_HEADROOM = 0.9  # plan at most this fraction of --max_steps: a 10% faster device still ends on the clock
PEAK_BF16_TFLOPS = {"B300": 2250, "B200": 2250, "H200": 989, "H100": 989, "A100": 312}  # dense, per GPU
BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments (Muon keeps one): the upper bound


@dataclasses.dataclass
class RunPlan:
    model: str  # the ladder name, or "custom" for explicit shape flags
    n_layer: int
    n_head: int
    n_embd: int
    n_params: int
    block_params: int
    flops_per_token: float
    world_size: int
    seq_len: int
    tokens_per_step: int  # global, per optimizer step
    micro_batch: int  # sequences per device per forward/backward
    grad_accum_steps: int
    step_s: float  # forecast seconds per optimizer step
    steps: int  # forecast optimizer steps (never above max_steps)
    tokens: int  # forecast training tokens
    train_s: float  # forecast seconds of training
    tokens_per_param: float  # forecast tokens per block parameter
    memory_gib: float  # forecast per device
    fits: bool  # within the device memory
    matmul_tflops: float  # per device: measured, or --peak_tflops for a dry run
    efficiency: float

    def line(self):
        return (
            f"{self.model} ({self.n_params / 1e6:.1f}M params) | {self.tokens_per_step:,} tokens/step = "
            f"{self.world_size} x {self.micro_batch} x {self.seq_len} x {self.grad_accum_steps} accum | forecast "
            f"{self.step_s * 1e3:.4g} ms/step x {self.steps:,} steps = {self.tokens / 1e9:.4g}B tokens in "
            f"{self.train_s:.0f} s, {self.tokens_per_param:.3g} tokens/param, {self.memory_gib:.3g} GiB/device"
        )


def shape_config(name):
    for entry in LADDER:
        if entry[0] == name:
            return dict(zip(("n_layer", "n_head", "n_embd"), entry[1:]))
    raise ValueError(f"--model must be 'auto' or one of {', '.join(e[0] for e in LADDER)}, got {name!r}")


@lru_cache(maxsize=None)
def _shape_costs(shape_items, vocab_size, seq_len):
    with torch.device("meta"):  # no memory, no init
        model = get_model({"vocab_size": vocab_size, "seq_len": seq_len, **dict(shape_items)})
    return {
        "params": model.num_params(),
        "block_params": sum(p.numel() for p in model.blocks.parameters()),
        "flops_per_token": model.flops_per_token(),
        "n_tables": 1 + len(model.value_embeds),
    }


def shape_costs(shape, vocab_size, seq_len):
    """Parameter counts and FLOPs/token of a model config (shape and switches), built on the meta device."""
    return _shape_costs(tuple(sorted(shape.items())), vocab_size, seq_len)


def memory_needed(costs, shape, micro_batch, seq_len, bf16):
    """Bytes one device needs: weights and optimizer state, plus activations kept for backward (about 34 values
    x width x layers per token, and the embedding lookups); the head's logits are chunked, so they are small."""
    act_bytes = 2 if bf16 else 4
    per_token = (34 * shape["n_layer"] + 2 * costs["n_tables"]) * shape["n_embd"] * act_bytes
    return costs["params"] * BYTES_PER_PARAM + micro_batch * seq_len * per_token


def _shape_plan(
    name,
    shape,
    *,
    kind,
    world_size,
    budget_s,
    max_steps,
    seq_len,
    vocab_size,
    batch_size,
    micro_batch,
    batch_tokens,
    matmul_rate,
    efficiency,
    memory_bytes,
    bf16,
):
    costs = shape_costs(shape, vocab_size, seq_len)
    fpt = costs["flops_per_token"]
    tokens_per_s = matmul_rate * efficiency * world_size / fpt
    if batch_tokens is None:  # the budget fits in STEP_HEADROOM of --max_steps, and never below the recipe
        batch_tokens = max(MIN_TOKENS_PER_STEP[kind], math.ceil(tokens_per_s * budget_s / (STEP_HEADROOM * max_steps)))
    seqs = max(1, math.ceil(batch_tokens / (world_size * seq_len)))  # per device per step
    if micro_batch is None:
        cap = max(1, MAX_MICRO_TOKENS[kind] // seq_len)
        while cap > 1 and memory_needed(costs, shape, cap, seq_len, bf16) > memory_bytes:
            cap //= 2
        accum = math.ceil(seqs / max(cap, batch_size))
        micro_batch = max(batch_size, math.ceil(seqs / accum))
    else:
        accum = math.ceil(seqs / micro_batch)
    tokens_per_step = world_size * micro_batch * seq_len * accum
    step_s = tokens_per_step / tokens_per_s
    steps = min(max_steps, int(budget_s / step_s))
    memory = memory_needed(costs, shape, micro_batch, seq_len, bf16)
    return RunPlan(
        model=name,
        **{k: shape[k] for k in ("n_layer", "n_head", "n_embd")},
        n_params=costs["params"],
        block_params=costs["block_params"],
        flops_per_token=fpt,
        world_size=world_size,
        seq_len=seq_len,
        tokens_per_step=tokens_per_step,
        micro_batch=micro_batch,
        grad_accum_steps=accum,
        step_s=step_s,
        steps=steps,
        tokens=steps * tokens_per_step,
        train_s=steps * step_s,
        tokens_per_param=steps * tokens_per_step / costs["block_params"],
        memory_gib=memory / 2**30,
        fits=memory <= memory_bytes,
        matmul_tflops=matmul_rate / 1e12,
        efficiency=efficiency,
    )


def make_plan(*, model, shape, tokens_per_param, **spec):
    """(plan, table): the plan for the shape flags (`shape`, a config dict), a ladder name, or `model="auto"`,
    which plans every ladder shape (the table) and takes the largest that fits and trains >= tokens_per_param
    tokens per block parameter (the smallest that fits if none does). spec: see _shape_plan."""
    if shape:
        return _shape_plan("custom", shape, **spec), []
    if model != "auto":
        return _shape_plan(model, shape_config(model), **spec), []
    table = [_shape_plan(name, shape_config(name), **spec) for name, *_ in LADDER]
    fitting = [p for p in table if p.fits]
    if not fitting:
        raise ValueError(
            f"no model shape fits in device memory ({table[0].memory_gib:.3g} GiB needed for the "
            f"smallest); lower --batch_size or --seq_len"
        )
    enough = [p for p in fitting if p.tokens_per_param >= tokens_per_param]
    return (enough[-1] if enough else fitting[0]), table


# ----------------------------------------------------------------------------- device speed and memory


def measure_matmul_rate(device, seconds=0.5):
    """Sustained matmul FLOP/s in the dtype training computes in (bf16 on CUDA, fp32 on CPU)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: kernel selection and thread-pool start
    sync()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
        if device.type == "cuda" and reps % 10:
            continue
        sync()
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def agreed_matmul_rate(device, world_size):
    """This machine's matmul rate, the minimum over ranks so that every rank makes the same plan."""
    rate = torch.tensor([measure_matmul_rate(device)], device=device)
    if world_size > 1:
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return rate.item()


def peak_flops(device):
    """The GPU's published dense bf16 peak, for MFU; 0 when unknown (a CPU has none)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return 0.0


def device_memory(device):
    if device.type == "cuda":
        return 0.85 * torch.cuda.get_device_properties(device).total_memory  # headroom: allocator, NCCL
    return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU: shared with the data


# ----------------------------------------------------------------------------- the clock


def last_step(step, elapsed, budget_s, step_s, reserve_s, max_steps, planned_last):
    """Index of the last step to run, or None to stop now: steps take step_s, and reserve_s of the time left goes
    to planned validation. The planned steps end inside the budget; when none fits any more but the planned last
    step has not run, it still starts inside the budget (and ends less than a step past it), so the run always
    ends on its floor-LR step. No whole step of slack: with the organizers' step cap a step can be ~1/7 of the
    budget."""
    fit = int((budget_s - elapsed - reserve_s) / step_s)
    if fit < 1:
        return step if step <= planned_last and elapsed < budget_s - reserve_s else None
    return min(max_steps - 1, step + fit - 1)


def next_sync(step, last, step_s, log_every_s):
    """The step of the next host sync: about every log_every_s, and at least twice more before the last step,
    so a late slowdown still moves the plan."""
    return step + max(1, min(int(log_every_s / step_s), (last - step) // 2))


def progress(step, last, end_forecast_s, budget_s, max_steps, previous):
    """Schedule progress of step (0-based): where the clock forecasts this step to end, or the step cap, whichever
    is ahead; exactly 1 at the planned last step; never back. Time, not steps, so a slow stretch moves it smoothly."""
    if step >= last:
        return 1.0
    return min(1.0, max(previous, end_forecast_s / budget_s, (step + 1) / max_steps))


def corrected_accum(step, elapsed, budget_s, step_s, reserve_s, max_steps, accum):
    """The accumulation whose whole steps, at the measured step time (assumed proportional to accumulation), fill
    most of the rest of the budget within STEP_HEADROOM x max_steps, or None when the current one already fits.
    With few steps left the rounding matters: 29 s and 5 steps of 0.5 s per accumulation take 11, not 10."""
    remaining = budget_s - elapsed - reserve_s
    available = max(int(STEP_HEADROOM * max_steps) - step, 1)
    if int(remaining / step_s) <= available:
        return None
    smallest = math.ceil(accum * remaining / (step_s * (available + 1)))
    while int(remaining / (step_s * smallest / accum)) > available:
        smallest += 1

    def used_s(new):
        new_step_s = step_s * new / accum
        return int(remaining / new_step_s) * new_step_s

    return max(range(smallest, 2 * smallest + 1), key=used_s)


# periodic validations together take at most VAL_SHARE of the budget, the final one FINAL_VAL_SHARE; before one is
# measured, a validation token is forecast to cost VAL_TOKEN_COST training tokens (a forward is a third of the FLOPs,
# run eagerly and unfused)
VAL_SHARE = 0.1
FINAL_VAL_SHARE = 0.25
VAL_TOKEN_COST = 0.5


class Clock:
    """The loop's time keeping, fed at every host sync with numbers all ranks agree on, so they decide alike:
    the steady step time (pauses taken out), what the periodic validations still to come may take, raising the
    accumulation (in the first half, only upward) when the step cap would end the run before the budget, the last
    step and the next sync. Pure arithmetic: unit-testable without sleeping."""

    def __init__(
        self,
        budget_s,
        max_steps,
        accum,
        log_every_s,
        may_replan,
        planned_step_s=None,
        micro_tokens=1,
        val_every_s=0.0,
        val_until_s=0.0,
        val_batches=0,
        val_tokens=0,
    ):
        self.budget_s, self.max_steps, self.accum, self.log_every_s = budget_s, max_steps, accum, log_every_s
        self.may_replan, self.micro_tokens, self.notes = may_replan, micro_tokens, []
        self.planned_step_s = planned_step_s  # the plan's forecast, the step time before any is measured
        self.val_every_s, self.val_until_s = val_every_s, val_until_s  # periodic validation stops at val_until_s
        self.val_batches, self.val_tokens, self.val_token_s = val_batches, val_tokens, None
        self.step_s, self.compile_s, self.last, self.sync_at = None, 0.0, max_steps - 1, 0
        self.end_s = budget_s  # forecast end of training: the budget, or sooner when the step cap binds
        self.prev_step, self.prev_elapsed, self.prev_paused = 0, 0.0, 0.0
        self._said = set()

    def _say_once(self, key, note):
        if key not in self._said:
            self._said.add(key)
            self.notes.append(note)

    def _val_batch_s(self):
        """Forecast seconds of a validation batch: from the measured cost of a validation token or, before one is
        measured, VAL_TOKEN_COST x a training token's."""
        token_s = self.val_token_s or VAL_TOKEN_COST * self.step_s / (self.micro_tokens * self.accum)
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
        if self.step_s is None and self.val_token_s is None:
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
        if not due or self.step_s is None or not self.val_batches:
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

    def sync(self, step, elapsed, paused, val_token_s):
        """Take the clock after `step` steps: elapsed and paused (validation, saves) seconds, and val_token_s, what a
        validation token took (0 before the first validation). Returns the stop reason, or None to go on."""
        steps = step - self.prev_step
        interval = (elapsed - self.prev_elapsed - (paused - self.prev_paused)) / max(steps, 1)
        if step == 1:
            self.compile_s = elapsed  # the first step carries compilation and warm-up
        elif step > 1 and steps:  # from step 1 on the step time is measured
            if self.step_s is not None and interval > 3 * self.step_s:
                self.notes.append(
                    f"stall: {(interval - self.step_s) * steps:.1f} s lost between steps {self.prev_step} and {step}"
                )
            self.step_s = interval if self.step_s is None else 0.5 * self.step_s + 0.5 * interval
        self.prev_step, self.prev_elapsed, self.prev_paused = step, elapsed, paused
        self.val_token_s = val_token_s or self.val_token_s
        if step >= self.max_steps:
            return "max_steps"
        reserve_s = 0.0
        if self.val_every_s > 0 and self.step_s is not None:
            future_vals = max(math.ceil((self.val_until_s - elapsed) / self.val_every_s), 0)
            reserve_s = future_vals * self._batches_per_validation()[1]
        if self.may_replan and self.step_s is not None and elapsed < self.budget_s / 2:
            # the device is faster than the plan: accumulate more so the step cap does not end the run early
            new = corrected_accum(step, elapsed, self.budget_s, self.step_s, reserve_s, self.max_steps, self.accum)
            if new is not None:
                self.notes.append(
                    f"replan: {self.step_s * 1e3:.4g} ms/step measured; accumulation {self.accum} -> "
                    f"{new} so the budget fits in --max_steps"
                )
                self.step_s, self.accum = self.step_s * new / self.accum, new
        forecast_s = self.step_s or (self.planned_step_s if step == 0 else None) or max(elapsed, 1e-3) / max(step, 1)
        planned = last_step(step, elapsed, self.budget_s, forecast_s, reserve_s, self.max_steps, self.last)
        if planned is None:
            return "time_limit" if step > 0 else None
        self.last = planned  # before the first measured step, planned from the compile step: early, never late
        if self.step_s is None:
            self.sync_at = step + 1  # steps 0-1: compile time, then the first measured step
        else:
            self.sync_at = next_sync(step, self.last, self.step_s, self.log_every_s)
            self.end_s = min(self.budget_s, elapsed + reserve_s + (self.last - step + 1) * self.step_s)
        return None

    def progress(self, step, previous):
        end_forecast = self.prev_elapsed + (step - self.prev_step + 1) * (self.step_s or 0.0)
        return progress(step, self.last, end_forecast, self.budget_s, self.max_steps, previous)

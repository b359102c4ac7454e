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

from clock import STEP_HEADROOM
from headloss import LOSS_CHUNK_BYTES, chunk_rows
from model import GPTConfig, get_model

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
PEAK_BF16_TFLOPS = {"B300": 2250, "B200": 2250, "H200": 989, "H100": 989, "A100": 312}  # dense, per GPU
BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments (Muon keeps one): the upper bound
# with several ranks, DDP's fp32 gradient buckets: the gradients are views of them once a step has synced, but a
# step's first micro-steps make fresh gradients while .grad is None (step 0, and a step after a rollback)
BUCKET_BYTES_PER_PARAM = 4
# a rollback snapshot (rollback.Snapshot) per parameter: its fp32 weight and the optimizer state, exactly: two AdamW
# moments, or Muon's one momentum for the hidden matrices
SNAPSHOT_BYTES = {"adamw": 12, "muon": 8}
# when the step cap forces the batch, split it into at least this many accumulation micro-steps, so the clock can move
# the batch in quarters when the device is not the forecast (only the accumulation moves after step 0: a new
# micro-batch is a new compiled graph). 4, not 6: on a fake clock at the event, 0.25x-4x the forecast speed, it fills
# the cap as well (mean 4,425 steps against 6's 4,400) with a third fewer micro-steps, each of which costs the host
# ~33 compiled calls and ~130 eager ops and the device ~1.2 ms of fixed work (BENCHMARKS.md, "The host's share")
FORCED_SPLIT = 4


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
    asked_tokens_per_step: int  # what the rules asked for, before whole micro-batches rounded it up
    micro_batch: int  # sequences per device per forward/backward
    grad_accum_steps: int
    min_accum: int  # the smallest the clock may replan to: the recipe's minimum tokens per step at this micro-batch
    step_s: float  # forecast seconds per optimizer step
    steps: int  # forecast optimizer steps (never above max_steps)
    tokens: int  # forecast training tokens
    train_s: float  # forecast seconds of training
    tokens_per_param: float  # forecast tokens per block parameter
    memory_gib: float  # forecast per device, without the rollback snapshots
    fits: bool  # within the device memory
    snapshot_gib: float  # the two rollback snapshots (trusted and pending)
    snapshots_on_device: bool  # rollback.Snapshot's test: room for both twice over on a CUDA device; else pinned host
    matmul_tflops: float  # per device: measured, or --peak_tflops for a dry run
    efficiency: float

    def line(self):
        snapshots = "on it" if self.snapshots_on_device else "in pinned host memory"
        return (
            f"{self.model} ({self.n_params / 1e6:.1f}M params) | {self.tokens_per_step:,} tokens/step = "
            f"{self.world_size} x {self.micro_batch} x {self.seq_len} x {self.grad_accum_steps} accum | forecast "
            f"{self.step_s * 1e3:.4g} ms/step x {self.steps:,} steps = {self.tokens / 1e9:.4g}B tokens in "
            f"{self.train_s:.0f} s, {self.tokens_per_param:.3g} tokens/param, {self.memory_gib:.3g} GiB/device + "
            f"{self.snapshot_gib:.3g} GiB of rollback snapshots {snapshots}"
        )


def shape_config(name):
    for entry in LADDER:
        if entry[0] == name:
            return dict(zip(("n_layer", "n_head", "n_embd"), entry[1:]))
    raise ValueError(f"--model must be 'auto' or one of {', '.join(e[0] for e in LADDER)}, got {name!r}")


@lru_cache(maxsize=None)
def _shape_costs(shape_items, vocab_size, seq_len):
    with torch.device("meta"):  # no memory, no init
        # a whole config, so switches not given take today's defaults however many are (model.model_config)
        model = get_model(
            {**dataclasses.asdict(GPTConfig()), "vocab_size": vocab_size, "seq_len": seq_len, **dict(shape_items)}
        )
    tables = [p for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()]
    # build_optimizers's rule: every matrix but the tables, the head and the ones the model names goes to Muon
    named = model.optimizer_groups()
    muon = [
        p
        for n, p in model.named_parameters()
        if p.ndim >= 2 and n not in named and not n.startswith("lm_head.") and all(p is not t for t in tables)
    ]
    return {
        "params": model.num_params(),
        "block_params": sum(p.numel() for p in model.blocks.parameters()),
        "flops_per_token": model.flops_per_token(),
        "n_tables": 1 + len(model.value_embeds) + (model.bigram is not None),
        "table_params": sum(p.numel() for p in tables),
        "muon_params": sum(p.numel() for p in muon),
        "largest_param": max(p.numel() for p in model.parameters()),
        "head_shape": (model.padded_vocab, model.config.n_embd),
        "token_embedding_params": model.wte.weight.numel(),
        "dense_mixes": len(model.mudd) if model.mudd is not None else 0,
    }


def shape_costs(shape, vocab_size, seq_len):
    """Parameter counts and FLOPs/token of a model config (shape and switches), built on the meta device."""
    return _shape_costs(tuple(sorted(shape.items())), vocab_size, seq_len)


def memory_needed(
    costs, shape, micro_batch, seq_len, bf16, *, kind, world_size, tail_ema=False, snoo=False, smoothing=False
):
    """Bytes one device needs: weights and optimizer state (with several ranks DDP's gradient buckets; with the tail
    EMA, its fp32 copy of every weight but the token embedding; extra_state_bytes), activations kept for backward
    (about 34 values x width x layers per token, the embedding lookups, 2 per MUDD mix: its normalised input and its
    output) and what a step holds for a moment (transient_bytes). The rollback snapshots are apart (snapshot_bytes):
    they go to pinned host memory when the device has no room."""
    act_bytes = 2 if bf16 else 4
    per_token = (34 * shape["n_layer"] + 2 * costs["n_tables"] + 2 * costs["dense_mixes"]) * shape["n_embd"] * act_bytes
    per_param = BYTES_PER_PARAM + BUCKET_BYTES_PER_PARAM * (world_size > 1)
    state = costs["params"] * per_param + (costs["params"] - costs["token_embedding_params"]) * 4 * tail_ema
    state += extra_state_bytes(costs, snoo, smoothing, kind)
    return state + micro_batch * seq_len * per_token + transient_bytes(costs, micro_batch * seq_len, kind, world_size)


def transient_bytes(costs, micro_tokens, kind, world_size):
    """The largest buffers a step makes and frees, all counted at once (an upper bound): the head's one chunk of
    logits (the matmul's output, its float32 copy and the loss math's two float32 buffers; float32 gradients of the
    head and the chunk's input), each micro-step's dense float32 gradients of the embedding tables before they are
    added to .grad, and with several ranks the bf16 gradient hook's float32 quotient and bf16 copy of the largest
    bucket (a parameter larger than DDP's 25 MiB buckets is a bucket of its own) and Muon's bf16 all_gather."""
    vocab, width = costs["head_shape"]
    rows = chunk_rows(micro_tokens, vocab, LOSS_CHUNK_BYTES.get(kind, LOSS_CHUNK_BYTES["cpu"]))
    head = 4 * rows * vocab * 4 + (vocab + micro_tokens) * width * 4
    tables = costs["table_params"] * 4
    gather = costs["muon_params"] * (2 if kind == "cuda" else 4)  # Newton-Schulz's dtype
    exchange = 6 * max(costs["largest_param"], (25 << 20) // 4) + gather if world_size > 1 else 0
    return head + tables + exchange


def extra_state_bytes(costs, snoo, smoothing, kind):
    """Optimizer state beyond AdamW's moments and Muon's momentum: Snoo's slow weights and outer momentum (fp32, every
    parameter), Muon's smoothed updates (its matrices, in Newton-Schulz's dtype: bf16 on CUDA)."""
    return costs["params"] * 8 * snoo + costs["muon_params"] * (2 if kind == "cuda" else 4) * smoothing


def snapshot_bytes(costs, muon, snoo=False, smoothing=False, kind="cpu"):
    """One rollback snapshot (rollback.Snapshot): the float32 weights and the optimizer state, two AdamW moments a
    parameter, one momentum for Muon's matrices, and extra_state_bytes."""
    return (
        costs["params"] * (4 + 8)
        - (costs["muon_params"] * 4 if muon else 0)
        + extra_state_bytes(costs, snoo, smoothing, kind)
    )


def _micro_and_accum(
    costs, shape, seqs, *, kind, world_size, seq_len, batch_size, micro_batch, memory_bytes, bf16, split=1, **held
):
    """(sequences per device per forward, accumulation) for seqs sequences per device per step, in at least `split`
    micro-steps where --batch_size allows."""
    if micro_batch is None:
        cap = max(1, MAX_MICRO_TOKENS[kind] // seq_len)
        held = dict(kind=kind, world_size=world_size, **held)
        accum = max(math.ceil(seqs / max(cap, batch_size)), min(split, seqs // batch_size))
        # the fewest micro-steps whose micro-batch fits in memory (a plan that fits none is refused by check_plan)
        while math.ceil(seqs / accum) > batch_size and (
            memory_needed(costs, shape, math.ceil(seqs / accum), seq_len, bf16, **held) > memory_bytes
        ):
            accum = math.ceil(seqs / (math.ceil(seqs / accum) - 1))
        return max(batch_size, math.ceil(seqs / accum)), accum
    return micro_batch, math.ceil(seqs / micro_batch)


def _step_batches(costs, shape, tokens_per_s, world_size, budget_s, max_steps, batch_tokens, sizing):
    """(micro-batch, accumulation, the tokens per step asked for) for --batch_tokens, or for the recipe's minimum
    raised so that the budget fits in STEP_HEADROOM x max_steps."""
    kind, seq_len = sizing["kind"], sizing["seq_len"]
    if batch_tokens is None:
        # at least 1 / STEP_HEADROOM steps' worth of budget: with --max_steps 1 the one step fits inside the budget
        steps = max(STEP_HEADROOM * max_steps, 1 / STEP_HEADROOM)
        batch_tokens = max(MIN_TOKENS_PER_STEP[kind], math.ceil(tokens_per_s * budget_s / steps))
    forced = batch_tokens > MIN_TOKENS_PER_STEP[kind] and sizing["micro_batch"] is None
    seqs = math.ceil(batch_tokens / (world_size * seq_len))
    micro_batch, accum = _micro_and_accum(costs, shape, seqs, **sizing, split=FORCED_SPLIT if forced else 1)
    return micro_batch, accum, batch_tokens


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
    batch_tokens,
    matmul_rate,
    efficiency,
    memory_bytes,
    bf16,
    muon=True,
    tail_ema=False,
    snoo=False,
    smoothing=False,
    **micro,
):
    costs = shape_costs(shape, vocab_size, seq_len)
    tokens_per_s = matmul_rate * efficiency * world_size / costs["flops_per_token"]
    held = dict(kind=kind, world_size=world_size, tail_ema=tail_ema, snoo=snoo, smoothing=smoothing)  # beyond the shape
    sizing = dict(seq_len=seq_len, memory_bytes=memory_bytes, bf16=bf16, **held, **micro)
    micro_batch, accum, asked = _step_batches(
        costs, shape, tokens_per_s, world_size, budget_s, max_steps, batch_tokens, sizing
    )
    tokens_per_step = world_size * micro_batch * seq_len * accum
    step_s = tokens_per_step / tokens_per_s
    unit_s = step_s / accum  # a micro-step's seconds, as the clock counts them
    steps = min(max_steps, int(budget_s / (unit_s * accum)))
    train_s = steps * unit_s * accum
    memory = memory_needed(costs, shape, micro_batch, seq_len, bf16, **held)
    snapshots = 2 * snapshot_bytes(costs, muon, snoo, smoothing, kind)  # trusted and pending
    return RunPlan(
        model=name,
        **{k: shape[k] for k in ("n_layer", "n_head", "n_embd")},
        n_params=costs["params"],
        block_params=costs["block_params"],
        flops_per_token=costs["flops_per_token"],
        world_size=world_size,
        seq_len=seq_len,
        tokens_per_step=tokens_per_step,
        asked_tokens_per_step=asked,
        micro_batch=micro_batch,
        grad_accum_steps=accum,
        min_accum=min(accum, max(1, math.ceil(MIN_TOKENS_PER_STEP[kind] / (world_size * micro_batch * seq_len)))),
        step_s=step_s,
        steps=steps,
        tokens=steps * tokens_per_step,
        train_s=train_s,
        tokens_per_param=steps * tokens_per_step / costs["block_params"],
        memory_gib=memory / 2**30,
        fits=memory <= memory_bytes,
        snapshot_gib=snapshots / 2**30,
        snapshots_on_device=kind != "cuda" or memory_bytes - memory > 2 * snapshots,
        matmul_tflops=matmul_rate / 1e12,
        efficiency=efficiency,
    )


def make_plan(*, model, shape, tokens_per_param, switches=None, **spec):
    """(plan, table): the plan for the shape flags (`shape`, a config dict), a ladder name, or `model="auto"`,
    which plans every ladder shape (the table) and takes the largest that fits and trains >= tokens_per_param
    tokens per block parameter (the smallest that fits if none does). switches: model.py switches given as flags,
    which a ladder shape's costs count too (a bigram table's parameters and memory). spec: see _shape_plan."""
    if shape:
        return _shape_plan("custom", shape, **spec), []
    if model != "auto":
        return _shape_plan(model, {**shape_config(model), **(switches or {})}, **spec), []
    table = [_shape_plan(name, {**shape_config(name), **(switches or {})}, **spec) for name, *_ in LADDER]
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

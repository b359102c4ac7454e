"""Model size matched to the compute: the shape comes from world size x budget x measured speed.

Rule (`--model auto`): the token budget of a shape is
    D = matmul_rate x efficiency x world_size x budget_s / flops_per_token(shape)
and the pick is the largest shape of LADDER that fits in memory and still sees at least
`tokens_per_param` tokens per block parameter (the smallest shape if none does). Block parameters are
the transformer blocks' weights, ~12 x n_layer x n_embd^2 (Kaplan et al.'s N): the capacity that grows
with the shape. The embeddings and the 32K-wide head are fixed by the vocabulary; they cost FLOPs (in D)
but do not say how large the model is, and at CPU widths they would be most of the count.
matmul_rate is measured, not looked up: a fraction of a second of large matmuls in the training dtype,
the minimum over ranks, so every rank picks the same shape. `efficiency` (the fraction of that rate a
training step reaches) and `tokens_per_param` are per device kind: see the tables below.
More compute can only raise every D, so the pick is monotone in compute.
"""
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
# CPU: from the 2/5/10-minute ladder runs in BENCHMARKS.md (steps reach 0.16-0.41 of the matmul rate; the
# winner l4w128 needs a ratio in (0.031, 0.101] at every budget: a model this starved is still learning unigram
# and bigram statistics, where more steps beat more capacity). CUDA: assumed, Chinchilla's 20 tokens/param
# at 0.4 of the bf16 matmul rate, until a GPU ladder measures them.
AUTO_EFFICIENCY = {"cuda": 0.4, "cpu": 0.2}
TOKENS_PER_PARAM = {"cuda": 20.0, "cpu": 0.05}
PEAK_BF16_TFLOPS = {"B300": 2250, "B200": 2250, "H200": 989, "H100": 989, "A100": 312}  # dense, per GPU
BYTES_PER_PARAM = 16  # fp32 weight + grad + two AdamW moments (Muon keeps one): the upper bound


def shape_config(name):
    for entry in LADDER:
        if entry[0] == name:
            return dict(zip(("n_layer", "n_head", "n_embd"), entry[1:]))
    raise ValueError(f"--model must be 'auto' or one of {', '.join(e[0] for e in LADDER)}, got {name!r}")


@lru_cache(maxsize=None)
def shape_costs(name, vocab_size, seq_len):
    """Parameter counts and FLOPs/token of a ladder shape, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = get_model({"vocab_size": vocab_size, "seq_len": seq_len, **shape_config(name)})
    return {"params": model.num_params(), "matmul_params": model.num_params(non_embedding=True),
            "block_params": sum(p.numel() for p in model.blocks.parameters()),
            "flops_per_token": model.flops_per_token()}


def memory_needed(costs, config, batch_size, seq_len, bf16):
    """Bytes one rank needs: weights and optimizer state, plus a per-token activation estimate
    (about 34 values x width x layers kept for backward, and the fp32 logits with their gradient)."""
    act_bytes = 2 if bf16 else 4
    per_token = 34 * config["n_embd"] * config["n_layer"] * act_bytes + 3 * 4 * config["vocab_size"]
    return costs["params"] * BYTES_PER_PARAM + batch_size * seq_len * per_token


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
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def pick_shape(*, matmul_rate, efficiency, world_size, budget_s, vocab_size, seq_len, batch_size,
               memory_bytes, bf16, tokens_per_param):
    """(name, table): the chosen ladder entry and the numbers behind every candidate."""
    table, choice = [], None
    for name, *_ in LADDER:
        config = {"vocab_size": vocab_size, "seq_len": seq_len, **shape_config(name)}
        costs = shape_costs(name, vocab_size, seq_len)
        tokens = matmul_rate * efficiency * world_size * budget_s / costs["flops_per_token"]
        fits = memory_needed(costs, config, batch_size, seq_len, bf16) <= memory_bytes
        ratio = tokens / costs["block_params"]
        table.append({"name": name, **costs, "tokens": tokens, "tokens_per_param": ratio, "fits": fits})
        if fits and (choice is None or ratio >= tokens_per_param):
            choice = name
    if choice is None:
        raise ValueError(f"no model shape fits in {memory_bytes / 2**30:.1f} GiB; lower --batch_size or --seq_len")
    return choice, table


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


def choose_shape(device, world, *, budget_s, vocab_size, seq_len, batch_size, bf16, efficiency, tokens_per_param, say):
    """--model auto on this machine: (shape name, efficiency used, tokens_per_param used); logs the table.
    A negative efficiency or tokens_per_param takes the device kind's value from the tables above."""
    rate = torch.tensor([measure_matmul_rate(device)], device=device)
    if world > 1:  # every rank must build the same model
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    efficiency = AUTO_EFFICIENCY[device.type] if efficiency < 0 else efficiency
    tokens_per_param = TOKENS_PER_PARAM[device.type] if tokens_per_param < 0 else tokens_per_param
    name, table = pick_shape(matmul_rate=rate.item(), efficiency=efficiency, world_size=world, budget_s=budget_s,
                             vocab_size=vocab_size, seq_len=seq_len, batch_size=batch_size,
                             memory_bytes=device_memory(device), bf16=bf16, tokens_per_param=tokens_per_param)
    say(f"model auto: matmul {rate.item() / 1e12:.3g} TFLOP/s x efficiency {efficiency} x {world} ranks x "
        f"{budget_s / 60:g} min; want >= {tokens_per_param:g} tokens per block param")
    for row in table:
        say(f"  {'->' if row['name'] == name else '  '} {row['name']:>9}: {row['block_params'] / 1e6:8.2f}M block params, "
            f"{row['tokens'] / 1e6:10.3g}M tokens, {row['tokens_per_param']:10.3g} tokens/param"
            f"{'' if row['fits'] else ', does not fit in memory'}")
    return name, efficiency, tokens_per_param

"""Model size matched to the compute: the shape comes from world size x budget x measured speed.

Rule (`--model auto`): the token budget of a shape is
    D = matmul_rate x efficiency x world_size x budget_s / flops_per_token(shape)
and the pick is the largest shape of LADDER that fits in memory and still sees at least
`tokens_per_param` tokens per non-embedding parameter (the smallest shape if none does).
matmul_rate is measured, not looked up: a few seconds' worth of large matmuls in the training dtype,
the same on every rank (the minimum over ranks), so every rank picks the same shape. `efficiency` is
the fraction of that rate a training step reaches (measured per device kind, see BENCHMARKS.md).
More compute can only raise every D, so the pick is monotone in compute.
"""
import os
import time
from functools import lru_cache

import torch

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
        ratio = tokens / costs["matmul_params"]
        table.append({"name": name, **costs, "tokens": tokens, "tokens_per_param": ratio, "fits": fits})
        if fits and (choice is None or ratio >= tokens_per_param):
            choice = name
    if choice is None:
        raise ValueError(f"no model shape fits in {memory_bytes / 2**30:.1f} GiB; lower --batch_size or --seq_len")
    return choice, table


def device_memory(device):
    if device.type == "cuda":
        return 0.85 * torch.cuda.get_device_properties(device).total_memory  # headroom: allocator, NCCL
    return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # CPU: shared with the data

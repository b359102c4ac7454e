"""The per-step memory-bound work the FLOP forecast does not count: the cautious weight decay (Muon
and AdamW) and the embedding tables' per-micro-step gradients, before and after, in bytes per optimizer step at the
event's shape (arithmetic) and in CPU time side by side.

    python bench/step_work.py                                  # bytes at l16w1024, CPU times at l16w1024 (~5 GB)
    python bench/step_work.py --n_layer 12 --n_embd 768 --n_head 6 --repeats 5
    python bench/step_work.py --bytes_only

Bytes: every kernel's reads and writes (fp32 weights, moments and gradients; Muon's update in bf16, as on CUDA;
tests/test_step_work.py counts the decay's through the real optimizers). Times: one torch thread, before and after
alternating, the fastest of --repeats each; on a shared machine read the ratio, not the seconds.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import bigram_hash, get_model, lookup  # noqa: E402
from muon import cautious_decay_  # noqa: E402
from optimizers import build_optimizers  # noqa: E402

HBM_BYTES_S = 7e12  # a B300's achievable HBM bandwidth (the review's figure), for milliseconds
F32, BF16, BOOL = 4, 2, 1


def decay_kernels(direction_bytes):
    """(kernel, bytes read + written per entry) of the cautious decay, before (commit ccb28b6) and after."""
    before = [
        ("direction * p", direction_bytes + F32 + F32),
        ("> 0", F32 + BOOL),
        ("p * mask", F32 + BOOL + F32),
        ("p.sub_(...)", F32 + F32 + F32),
    ]
    after = [
        ("direction * p", direction_bytes + F32 + F32),
        ("> 0", F32 + BOOL),
        ("p.addcmul_(p, mask)", F32 + BOOL + F32),
    ]
    return before, after


def before_cautious_decay_(p, direction, decay):
    """The cautious decay as it was (commit ccb28b6): 4 kernels."""
    p.sub_(p * (direction * p > 0), alpha=decay)


def event_model(args):
    config = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size)
    with torch.device("meta"):
        model = get_model(config)
    muon, adamw = build_optimizers(
        model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04, muon_weight_decay=1.2, adam_weight_decay=0.005
    )
    muon_shapes = [tuple(p.shape) for g in muon.param_groups for p in g["params"]]
    decayed_shapes = [tuple(p.shape) for g in adamw.param_groups if g["cautious_wd"] for p in g["params"]]
    tables = [model.bigram, model.wte, *model.value_embeds]
    return model, muon_shapes, decayed_shapes, [tuple(t.weight.shape) for t in tables]


def table_grad_bytes(rows, width, tokens, accum):
    """Bytes of one table's gradient over an optimizer step of `accum` micro-steps of `tokens` each. Every micro-step's
    lookup gradient costs 12 bytes per looked-up entry (read the output gradient, read and write the row). Before:
    each micro-step also zero-fills a table-sized gradient (embedding_dense_backward) and the 2nd..last add it into
    .grad (AccumulateGrad: read both, write one). After: only the first does; the others' sparse gradient is a view
    of the output gradient, added row by row. DDP's copy into its bucket on the last micro-step is the same in both."""
    table, looked_up = rows * width, tokens * width
    before = accum * (F32 * table + 3 * F32 * looked_up) + (accum - 1) * 3 * F32 * table
    after = F32 * table + accum * 3 * F32 * looked_up
    return before, after


def numel(shape):
    return torch.Size(shape).numel()


def bytes_table(args, muon_shapes, decayed_shapes, table_shapes):
    tokens = args.micro_batch * args.seq_len
    gb = 1e9
    rows = []
    muon_entries, decayed_entries = sum(map(numel, muon_shapes)), sum(map(numel, decayed_shapes))
    update_add = F32 + BF16 + F32
    for name, entries, direction, extra in [
        (f"Muon: cautious decay + update, {len(muon_shapes)} matrices", muon_entries, BF16, update_add),
        (f"AdamW: cautious decay after the fused step, {len(decayed_shapes)} tables", decayed_entries, F32, 0),
    ]:
        before, after = decay_kernels(direction)
        rows.append(
            (
                name,
                entries,
                f"{len(before) + bool(extra)} / {len(after) + bool(extra)}",
                entries * (sum(b for _, b in before) + extra) / gb,
                entries * (sum(b for _, b in after) + extra) / gb,
            )
        )
    for (r, c), name in zip(table_shapes, ["bigram table", "wte", *[f"value embedding {i}" for i in range(3)]]):
        before, after = table_grad_bytes(r, c, tokens, args.accum)
        rows.append((f"{name} gradient, {args.accum} micro-steps", r * c, "", before / gb, after / gb))
    print(
        f"\nBytes per optimizer step at l{args.n_layer}w{args.n_embd} (vocab {args.vocab_size}, micro-batch "
        f"{args.micro_batch} x {args.seq_len}, accumulation {args.accum}); ms at {HBM_BYTES_S / 1e12:g} TB/s\n"
    )
    print("| work | entries | kernels per tensor, before / after | GB before | GB after | ms before | ms after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, entries, kernels, before, after in rows:
        ms = 1e3 * gb / HBM_BYTES_S
        print(
            f"| {name} | {entries / 1e6:.1f}M | {kernels} | {before:.2f} | {after:.2f} | {before * ms:.2f} | "
            f"{after * ms:.2f} |"
        )
    total_before, total_after = sum(r[3] for r in rows), sum(r[4] for r in rows)
    ms = 1e3 * gb / HBM_BYTES_S
    print(
        f"| **total** | | | **{total_before:.2f}** | **{total_after:.2f}** | **{total_before * ms:.2f}** | "
        f"**{total_after * ms:.2f}** |"
    )


def fastest(variants, repeats):
    """{name: fastest seconds}, the variants alternating so the box's load falls on both alike."""
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def random_like(shapes, generator, zeros=0.0):
    """Gaussian tensors of these shapes, a fraction of their entries exactly 0 (zero gradients, zero-init weights)."""
    out = []
    for s in shapes:
        t = torch.randn(s, generator=generator)
        if zeros:
            t[torch.rand(s, generator=generator) < zeros] = 0.0
        out.append(t)
    return out


def time_decay(label, shapes, updated, repeats):
    """One decay (+ Muon's update) pass over these tensors, before against after."""
    g = torch.Generator().manual_seed(0)
    params, directions = random_like(shapes, g, zeros=0.01), random_like(shapes, g, zeros=0.01)

    def step(decay_):
        for p, d in zip(params, directions):
            decay_(p, d, 1e-6)
            if updated:
                p.add_(d, alpha=-1e-6)

    return report(
        label,
        fastest({"before": lambda: step(before_cautious_decay_), "after": lambda: step(cautious_decay_)}, repeats),
    )


def time_table_grads(model_tables, tokens, accum, repeats, vocab_size):
    g = torch.Generator().manual_seed(0)
    tables = [torch.nn.Embedding(r, c) for r, c in model_tables]
    idx = [torch.randint(0, vocab_size, (1, tokens + 1), generator=g) for _ in range(accum)]
    grads_out = [torch.randn(tokens, model_tables[0][1], generator=g) for _ in range(accum)]

    def step(sparse_later):
        for t in tables:
            t.weight.grad = None
        for x, grad_out in zip(idx, grads_out):
            for i, t in enumerate(tables):
                rows = bigram_hash(x, t.num_embeddings)[0, 1:] if i == 0 else x[0, 1:]
                out = lookup(t, rows) if sparse_later else F.embedding(rows, t.weight)
                out.backward(grad_out)

    return report(
        f"table gradients, {accum} micro-steps of {tokens} tokens",
        fastest({"before": lambda: step(False), "after": lambda: step(True)}, repeats),
    )


def report(label, best):
    before, after = best["before"], best["after"]
    print(f"| {label} | {before * 1e3:,.0f} | {after * 1e3:,.0f} | {before / after:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=16)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--micro_batch", type=int, default=13, help="sequences per micro-step (the event's plan: 13)")
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--accum", type=int, default=6, help="micro-steps per optimizer step (the event's plan: 6)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each variant (default 3)")
    parser.add_argument("--bytes_only", action="store_true", help="the arithmetic alone, no CPU timing")
    args = parser.parse_args()
    torch.set_num_threads(1)

    _, muon_shapes, decayed_shapes, table_shapes = event_model(args)
    bytes_table(args, muon_shapes, decayed_shapes, table_shapes)
    if args.bytes_only:
        return
    print(
        f"\nCPU, one thread, fastest of {args.repeats} (load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cpus; Muon's update in fp32, as on CPU)\n"
    )
    print("| work | before ms | after ms | before / after |")
    print("| --- | --- | --- | --- |")
    time_decay(f"Muon: cautious decay + update, {len(muon_shapes)} matrices", muon_shapes, True, args.repeats)
    time_decay(f"AdamW: cautious decay, {len(decayed_shapes)} tables", decayed_shapes, False, args.repeats)
    time_table_grads(table_shapes, args.micro_batch * args.seq_len, args.accum, args.repeats, args.vocab_size)


if __name__ == "__main__":
    main()

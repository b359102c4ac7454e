"""Bytes each rank sends per optimizer step: DDP's gradient all-reduce and Muon's all_gather, before and
after the gradient all-reduce moved from fp32 to bf16, computed from the code's own bucket and share sizes.

    python bench/comm_bytes.py [--shapes l12w768,l16w1024] [--worlds 8,32] [--buckets] [--check]

Without --check nothing is allocated: the models are built on the meta device, and no process group starts.
- DDP buckets. torch 2.13's DDP (find_unused_parameters=False) reduces every gradient in one bucket on the
  first step, then its Reducer rebuilds the buckets from the order in which that step's gradients became
  ready, filling them in that order up to [dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB), then bucket_cap_mb
  (25 MiB)] of fp32 gradient bytes; a bucket closes on the parameter that reaches its limit. Here the ready
  order is recorded from a backward pass on the meta device (the eager model; compiled blocks only permute
  parameters inside a block) and handed to the same C++ function, dist._compute_bucket_assignment_by_size,
  with DDP's own limits. --check compares the result with a real 1-rank gloo DDP on CPU.
  The bytes do not depend on the bucketing (each gradient is in exactly one bucket); the buckets decide how
  many collectives there are and which of them can overlap the backward pass.
- bf16_compress_hook casts each (fp32) bucket to bf16 before its all-reduce: the same buckets, 2 bytes per
  gradient instead of 4. (torch refuses that hook without NCCL: CUDA only.)
- Muon. muon.py's own Muon._exchange runs with the collective swapped for a recorder, which reads the
  padded width (the largest rank's share, from _assign_to_ranks over _newtonschulz_flops). The exchange is
  bf16 on CUDA (muon.py), before and after.

Ring algorithms (what NCCL's bus bandwidth counts), W ranks:
    all-reduce of B bytes:               each rank sends 2 (W-1)/W x B   (reduce-scatter, then all-gather)
    all_gather of W equal chunks of S:   each rank sends (W-1) x S       (= (W-1)/W x the W x S output)
Each rank receives as many bytes as it sends. MiB = 2**20 bytes.
"""

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB, _MB_TO_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import muon
import optimizers
from model import get_model

SHAPES = {
    "l12w768": {"n_layer": 12, "n_head": 6, "n_embd": 768},
    "l16w1024": {"n_layer": 16, "n_head": 8, "n_embd": 1024},
}
VOCAB, SEQ_LEN = 32000, 1024
BUCKET_LIMITS = [dist._DEFAULT_FIRST_BUCKET_BYTES, _DEFAULT_BUCKET_CAP_MB * _MB_TO_BYTES]  # DDP's defaults
MUON_BYTES = 2  # the exchange dtype on CUDA: bf16
MiB = 2**20


def ddp_parameters(model):
    """(name, parameter) in DDP's order (_build_params_for_reducer): modules in named_modules order, each
    module's own parameters, shared ones once."""
    seen, named = set(), []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                named.append((f"{module_name}.{name}".lstrip("."), p))
    return named


def grad_ready_order(model, params):
    """Indices into params in the order their gradients finish accumulating in one backward pass."""
    device = params[0].device
    index = {id(p): i for i, p in enumerate(params)}
    order = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: order.append(index[id(p)])) for p in params]
    idx = torch.zeros(1, 8, dtype=torch.long, device=device)
    model(idx, idx)[1].backward()
    for hook in hooks:
        hook.remove()
    return order


def ddp_buckets(params, order):
    """The rebuilt buckets, in the order they become ready: lists of indices into params."""
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], BUCKET_LIMITS, [False] * len(order), order
    )
    return buckets


def muon_width(model, world):
    """(padded width, total elements) of Muon's all_gather at this world size, read from Muon._exchange."""
    optimizer = optimizers.build_optimizers(model, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]  # all get gradients
    owners = muon._assign_to_ranks([muon._newtonschulz_flops(p.shape) for p in params], world)
    ortho = {i: torch.empty_like(p) for i, p in enumerate(params) if owners[i] == 0}
    widths = []
    with mock.patch.object(muon, "all_gather_flat", lambda out, send: widths.append(send.numel())):
        muon.Muon._exchange(params, owners, ortho, world, 0)
    return widths[0], sum(p.numel() for p in params)


def analyse(shape_name):
    with torch.device("meta"):
        model = get_model({"vocab_size": VOCAB, "seq_len": SEQ_LEN, **SHAPES[shape_name]})
    named = ddp_parameters(model)
    names, params = [n for n, _ in named], [p for _, p in named]
    order = grad_ready_order(model, params)
    buckets = ddp_buckets(params, order)
    fp32_bytes = [sum(params[i].numel() * 4 for i in bucket) for bucket in buckets]
    # buckets that become ready after the last block gradient: nothing is left to overlap them with
    last_block = max(order.index(i) for i, n in enumerate(names) if n.startswith("blocks."))
    after_blocks = {order[k] for k in range(last_block + 1, len(order))}
    tail = [b for b, bucket in enumerate(buckets) if after_blocks & set(bucket)]
    return {
        "model": model,
        "names": names,
        "params": params,
        "buckets": buckets,
        "fp32_bytes": fp32_bytes,
        "tail": tail,
    }


def describe(names, bucket, limit=4):
    listed = [names[i] for i in bucket]
    return ", ".join(listed) if len(listed) <= limit else f"{', '.join(listed[: limit - 1])}, ... ({len(listed)})"


def check_against_ddp(shape_name, expected):
    """A real DDP (gloo, 1 rank, CPU, eager) at this shape: its rebuilt bucket sizes must equal ours."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to pick
    model = DDP(
        get_model({"vocab_size": VOCAB, "seq_len": SEQ_LEN, **SHAPES[shape_name]}), gradient_as_bucket_view=True
    )
    idx = torch.zeros(1, 8, dtype=torch.long)
    for _ in range(3):  # step 1 records the ready order, step 2's forward rebuilds, step 3's logs the sizes
        model(idx, idx)[1].backward()
    measured = [int(s) for s in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    dist.destroy_process_group()
    print(
        f"check {shape_name}: real DDP rebuilt {len(measured)} buckets, "
        f"{'the same sizes as computed' if measured == expected else f'DIFFERENT: {measured} vs {expected}'}"
    )
    return measured == expected


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="l12w768,l16w1024", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--worlds", default="8,32", help="comma-separated world sizes")
    parser.add_argument("--buckets", action="store_true", help="list every bucket")
    parser.add_argument("--check", action="store_true", help="compare with a real 1-rank gloo DDP (CPU memory)")
    args = parser.parse_args()
    shapes, worlds = args.shapes.split(","), [int(w) for w in args.worlds.split(",")]
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")

    print(
        f"DDP bucket limits: first {BUCKET_LIMITS[0] / MiB:g} MiB, then {BUCKET_LIMITS[1] / MiB:g} MiB "
        f"(fp32 gradient bytes), filled in gradient-ready order\n"
    )
    print(
        "| shape | params | grads fp32 MiB | buckets | first ready | last ready (MiB fp32) | "
        "ready after the last block: buckets, MiB fp32 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    results = {name: analyse(name) for name in shapes}
    for name, r in results.items():
        b, names = r["fp32_bytes"], r["names"]
        print(
            f"| {name} | {sum(p.numel() for p in r['params']) / 1e6:.1f}M | {sum(b) / MiB:,.1f} | {len(b)} | "
            f"{describe(names, r['buckets'][0])} ({b[0] / MiB:.1f}) | {describe(names, r['buckets'][-1])} "
            f"({b[-1] / MiB:.1f}) | {len(r['tail'])}: {sum(b[t] for t in r['tail']) / MiB:,.1f} |"
        )
    if args.buckets:
        for name, r in results.items():
            print(f"\n{name} buckets, in the order they become ready:")
            for k, (bucket, size) in enumerate(zip(r["buckets"], r["fp32_bytes"])):
                print(f"  {k:3d} {size / MiB:8.2f} MiB  {describe(r['names'], bucket, limit=6)}")

    print(
        "\nPer rank per optimizer step, MiB sent (received: the same). Before: fp32 all-reduce; after: bf16 "
        "all-reduce (bf16_compress_hook). Muon's all_gather is bf16 in both.\n"
    )
    print(
        "| shape | W | all-reduce before | all-reduce after | Muon width (elements) | Muon padding | "
        "Muon all_gather | total before | total after | after / before |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        grad_bytes = sum(r["fp32_bytes"])
        for world in worlds:
            width, muon_elements = muon_width(r["model"], world)
            ring = 2 * (world - 1) / world
            before, after = ring * grad_bytes, ring * grad_bytes / 2
            gather = (world - 1) * width * MUON_BYTES
            print(
                f"| {name} | {world} | {before / MiB:,.1f} | {after / MiB:,.1f} | {width:,} | "
                f"{world * width / muon_elements - 1:.1%} | {gather / MiB:,.1f} | {(before + gather) / MiB:,.1f} | "
                f"{(after + gather) / MiB:,.1f} | {(after + gather) / (before + gather):.2f} |"
            )

    if args.check:
        ok = all(check_against_ddp(name, r["fp32_bytes"]) for name, r in results.items())
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""What MUDD (model.py --mudd) adds to a micro-step at the event's shape, counted on the meta device (no compute):
the aten ops dispatched, their bytes (each op's inputs and outputs, as an eager run moves them) and FLOPs (torch's
FLOP counter), forward and backward, with and without it, and per optimizer step at the event's plan.

    python bench/mudd_cost.py                          # l16w1024, 19 x 1024 tokens a micro-step, 4 micro-steps
    python bench/mudd_cost.py --layers 8 --width 128 --micro_batch 8 --seq_len 256 --accum 1   # the CPU runs' shape

Eager, as train.py runs the glue between the compiled blocks: every op a kernel that reads its inputs and writes its
outputs. The residual stream is fp32 (the blocks' outputs under bf16 autocast); the meta run has no autocast, so the
mixes' small matmuls count fp32 too (an upper bound on their bytes).
"""

import argparse
import pathlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from model import get_model  # noqa: E402

FREE = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "unsqueeze", "squeeze", "slice", "select",
        "split", "split_with_sizes", "unbind", "detach", "alias", "as_strided", "permute", "empty", "empty_like",
        "_to_copy_noop"}  # fmt: skip


class Bytes(TorchDispatchMode):
    """Ops that launch work and the bytes of their tensor inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in FREE:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def micro_step(args, mudd):
    """(forward ops, bytes), (backward ops, bytes) and the FLOPs of one micro-step."""
    shape = dict(n_layer=args.layers, n_embd=args.width, n_head=max(args.width // 128, 2), vocab_size=32000)
    with torch.device("meta"):
        model = get_model({**shape, "seq_len": args.seq_len, "mudd": mudd})
        idx = torch.zeros(args.micro_batch, args.seq_len, dtype=torch.long)
    for p in model.parameters():  # the meta init leaves them as they are; nothing here reads values
        p.grad = None
    forward, backward = Bytes(), Bytes()
    with FlopCounterMode(display=False) as flops:
        with forward:
            loss = model(idx, idx)[1]
        with backward:
            loss.backward()
    return (forward.ops, forward.bytes), (backward.ops, backward.bytes), flops.get_total_flops()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro_batch", type=int, default=19)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--accum", type=int, default=4, help="micro-steps per optimizer step")
    parser.add_argument("--hbm_tb_s", type=float, default=7.0, help="memory bandwidth for the ms column")
    args = parser.parse_args()
    off, on = micro_step(args, False), micro_step(args, True)
    print(f"l{args.layers}w{args.width}, {args.micro_batch} x {args.seq_len} tokens a micro-step, {args.accum} a step")
    for i, part in enumerate(("forward", "backward")):
        (ops0, bytes0), (ops1, bytes1) = off[i], on[i]
        step_gb = (bytes1 - bytes0) * args.accum / 1e9
        print(
            f"{part:>8}: ops {ops0} -> {ops1} (+{ops1 - ops0} a micro-step), bytes +{(bytes1 - bytes0) / 1e9:.2f} GB a "
            f"micro-step of {bytes0 / 1e9:.1f} ({(bytes1 - bytes0) / bytes0:.1%}), +{step_gb:.1f} GB a step = "
            f"{step_gb / args.hbm_tb_s:.2f} ms at {args.hbm_tb_s:g} TB/s"
        )
    added = on[2] - off[2]
    print(f"   FLOPs: +{added / 1e9:.2f} GFLOP a micro-step ({added / off[2]:.3%} of {off[2] / 1e12:.2f} TFLOP)")


if __name__ == "__main__":
    main()

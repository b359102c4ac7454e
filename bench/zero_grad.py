"""train.py's optimizer step with zero_grad(set_to_none=True) against set_to_none=False, side by side on CPU: one
process, and 2 gloo ranks under DDP with gradient_as_bucket_view and the bf16 gradient hook (train.py's set-up).

    python bench/zero_grad.py                          # l4w256, vocab 32000, 4 micro-steps of 4 x 256; 1 and 2 ranks
    python bench/zero_grad.py --world 2 --rounds 6

set_to_none=True drops every .grad after the step: the next step's first micro-step makes fresh ones (dense table
gradients too: model.SparseAfterFirst sees no .grad) and with DDP the sync micro-step copies each into its bucket.
set_to_none=False zeroes them in place: they stay bucket views, and the tables' first micro-step goes sparse.
Each mode runs --steps steps in a block, the first of a block (it inherits the other mode's gradients) untimed;
blocks alternate; the median step of each mode and their ratio, on rank 0. One torch thread per rank.
"""

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from config import Hyperparameters  # noqa: E402
from conftest import free_port, init_gloo  # noqa: E402
from headloss import head_loss  # noqa: E402
from model import get_model  # noqa: E402
from optimizers import build_optimizers  # noqa: E402
from ranks import bf16_grad_hook  # noqa: E402


def timed_steps(rank, world, port, args, out):
    if world > 1:
        init_gloo(rank, world, port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_embd // 64}
    model = get_model({**shape, "vocab_size": args.vocab_size, "seq_len": args.seq_len})
    hp = Hyperparameters()
    optimizers = build_optimizers(
        model,
        muon_lr=hp.muon_lr,
        embed_lr=hp.embed_lr,
        head_lr=hp.head_lr,
        scalar_lr=hp.scalar_lr,
        muon_weight_decay=hp.muon_weight_decay,
        adam_weight_decay=hp.adam_weight_decay,
        ns_coeffs=hp.ns_coeffs,
        normuon_beta2=hp.normuon_beta2,
    )
    wrapped = model
    if world > 1:
        wrapped = DDP(model, gradient_as_bucket_view=True)
        wrapped.register_comm_hook(None, bf16_grad_hook)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, args.vocab_size, (args.accum, args.micro, args.seq_len + 1), generator=generator)
    times = {True: [], False: []}
    for round_ in range(args.rounds):
        for set_to_none in (True, False) if round_ % 2 == 0 else (False, True):
            for i in range(args.steps):
                start = time.perf_counter()
                for micro in range(args.accum):
                    x, y = tokens[micro, :, :-1], tokens[micro, :, 1:]
                    with wrapped.no_sync() if world > 1 and micro < args.accum - 1 else nullcontext():
                        _, loss = wrapped(x, y, loss_fn=head_loss)
                        (loss / args.accum).backward()
                for opt in optimizers:
                    opt.step()
                wrapped.zero_grad(set_to_none=set_to_none)
                if i:
                    times[set_to_none].append(time.perf_counter() - start)
    if rank == 0:
        out.put({mode: statistics.median(ts) for mode, ts in times.items()})
    if world > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="per block; the first is not timed")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(
        f"l{args.n_layer}w{args.n_embd}, vocab {args.vocab_size}, {args.accum} micro-steps of {args.micro} x "
        f"{args.seq_len}, torch {torch.__version__}, median of {(args.steps - 1) * args.rounds} steps per mode"
    )
    print("| ranks | set_to_none=True ms/step | set_to_none=False ms/step | False / True |")
    print("| --- | --- | --- | --- |")
    for world in args.world:
        out = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(timed_steps, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
        best = out.get()
        print(f"| {world} | {1e3 * best[True]:.1f} | {1e3 * best[False]:.1f} | {best[False] / best[True]:.3f} |")


if __name__ == "__main__":
    main()

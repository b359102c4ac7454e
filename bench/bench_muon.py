"""Muon step time on the default model's hidden matrices: one process vs the per-rank share at world 2.

All with the same threads per process:
  single    one process runs Muon.step() over every matrix
  share     one process times what each rank of world 2 computes (momentum for all, Newton-Schulz for
            its share), without communication: the ideal per-rank cost
  gloo      two real gloo processes run the sharded step, exchange included (skipped with --no-gloo)
  exchange  the all_gather of that step alone, on the same two processes
Shapes come from model.py's get_model when it imports, else 12 layers of width 768 (q, k, v, out
768x768; MLP 3072x768 and 768x3072).

    python bench/bench_muon.py            # full default model (about 1.6 TFLOP of float32 per step)
    python bench/bench_muon.py --quick    # 2 layers, one timed step
    python bench/bench_muon.py --normuon --n_layer 4 --n_embd 128 --steps 50   # NorMuon off vs on, alternating
"""

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from muon import Muon, all_gather_flat, _assign_to_ranks, _newtonschulz_flops  # noqa: E402
from optimizers import build_optimizers  # noqa: E402


def matrix_shapes(n_layer, n_embd=768):
    try:
        from model import get_model
    except ImportError:
        return [(n_embd, n_embd)] * 4 * n_layer + [(4 * n_embd, n_embd), (n_embd, 4 * n_embd)] * n_layer
    with torch.device("meta"):  # shapes only: no 800 MB of embeddings
        model = get_model({"n_layer": n_layer, "n_embd": n_embd, "n_head": max(n_embd // 128, 1)})
    muon = build_optimizers(model, muon_lr=0.02, embed_lr=0.1, head_lr=0.1, scalar_lr=0.1)[0]
    return [tuple(p.shape) for p in muon.param_groups[0]["params"]]


def make_params(shapes):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def time_steps(step, warmup, steps):
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def time_share(params, owners, rank, warmup, steps):
    """What one rank computes per step, minus the exchange: Muon over its share, and the momentum and
    the applied update for everyone else's matrices."""
    share = Muon([p for p, owner in zip(params, owners) if owner == rank])
    others = [p for p, owner in zip(params, owners) if owner != rank]
    buffers = [torch.zeros_like(p) for p in others]

    @torch.no_grad()
    def step():
        share.step()
        for p, buf in zip(others, buffers):
            buf.lerp_(p.grad, 0.05)
            p.add_(buf, alpha=-1e-3)

    return time_steps(step, warmup, steps)


def gloo_worker(rank, world_size, port, shapes, width, threads, warmup, steps, out_path):
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
    )
    params = make_params(shapes)
    opt = Muon(params)

    def step():
        dist.barrier()  # every step starts together, so the slowest rank sets the time
        opt.step()

    send, gathered = torch.zeros(width), torch.empty(world_size * width)

    def exchange():  # the collective Muon.step runs, alone
        dist.barrier()
        all_gather_flat(gathered, send)

    seconds = torch.tensor([time_steps(step, warmup, steps), time_steps(exchange, 1, 3)], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_path).write_text(json.dumps(seconds.tolist()))
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13 + gloo: interpreter teardown after destroy_process_group sometimes aborts


def time_gloo(shapes, width, threads, warmup, steps, world_size=2):
    """(step, exchange) seconds of the slowest rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "seconds.json")
        mp.spawn(
            gloo_worker, args=(world_size, port, shapes, width, threads, warmup, steps, out_path), nprocs=world_size
        )
        return json.loads(Path(out_path).read_text())


def time_normuon(shapes, steps, threads):
    """Muon.step with NorMuon off and on over the same matrices, one step of each in turn (the box's load falls on
    both alike): the mean and the fastest of `steps` each."""
    params = make_params(shapes)
    optimizers = {beta2: Muon(params, lr=1e-4, normuon_beta2=beta2) for beta2 in (0.0, 0.95)}
    times = {beta2: [] for beta2 in optimizers}
    for beta2, opt in optimizers.items():
        opt.step()  # warm-up: state allocated
    for _ in range(steps):
        for beta2, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[beta2].append(time.perf_counter() - start)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"{len(shapes)} matrices, {numel / 1e6:.2f}M params, {threads} thread(s), {steps} alternating steps each, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    for beta2, t in times.items():
        print(f"normuon_beta2 {beta2}: mean {sum(t) / len(t) * 1e3:8.2f} ms, fastest {min(t) * 1e3:8.2f} ms")
    off, on = (sum(times[b]) / steps for b in (0.0, 0.95))
    print(f"on / off: {on / off:.3f} (mean), {min(times[0.95]) / min(times[0.0]):.3f} (fastest)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers and one timed step (a smoke run)")
    parser.add_argument("--n_layer", type=int, default=12, help="layers of matrices to time (default 12)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the real 2-process gloo run")
    parser.add_argument("--n_embd", type=int, default=768, help="width of the matrices (default 768)")
    parser.add_argument("--normuon", action="store_true", help="only Muon.step with NorMuon off vs on (beta2 0.95)")
    args = parser.parse_args()
    n_layer, steps = (2, 1) if args.quick else (args.n_layer, args.steps)
    torch.set_num_threads(args.threads)

    shapes = matrix_shapes(n_layer, args.n_embd)
    if args.normuon:
        return time_normuon(shapes, steps, args.threads)
    numels = [torch.Size(s).numel() for s in shapes]
    costs = [_newtonschulz_flops(torch.Size(s)) for s in shapes]
    owners = _assign_to_ranks(costs, 2)
    print(
        f"{len(shapes)} matrices, {sum(numels) / 1e6:.1f}M params, {5 * sum(costs) / 1e9:.0f} GFLOP of "
        f"Newton-Schulz a step; {args.threads} thread(s) a process, {steps} timed step(s) after 1 warm-up; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
    )
    for rank in range(2):
        share = [i for i, owner in enumerate(owners) if owner == rank]
        print(
            f"  world 2, rank {rank} owns {len(share)} matrices, "
            f"{sum(costs[i] for i in share) / sum(costs):.1%} of the Newton-Schulz flops"
        )

    params = make_params(shapes)
    single = time_steps(Muon(params).step, 1, steps)
    print(f"single process Muon.step       {single * 1e3:9.1f} ms  ({5 * sum(costs) / single / 1e9:.0f} GFLOP/s)")
    for rank in range(2):
        seconds = time_share(params, owners, rank, 1, steps)
        print(f"world 2 rank {rank} share, compute  {seconds * 1e3:9.1f} ms  ({single / seconds:.2f}x)")
    del params
    if not args.no_gloo:
        width = max(sum(n for n, owner in zip(numels, owners) if owner == rank) for rank in range(2))
        seconds, exchange = time_gloo(shapes, width, args.threads, 1, steps)
        print(f"world 2 gloo step, slowest rank {seconds * 1e3:9.1f} ms  ({single / seconds:.2f}x, exchange included)")
        print(
            f"world 2 gloo exchange alone     {exchange * 1e3:9.1f} ms  "
            f"(all_gather of {width / 1e6:.1f}M floats a rank)"
        )


if __name__ == "__main__":
    main()

"""Cold first-step time of torch.compile, the whole model against each block on its own, and the steady step.

    python bench/compile_time.py      # CPU, 1 thread: both modes at l12w768 and l16w1024, 1 x 64 tokens
    python bench/compile_time.py --device cuda --shapes l12w768 --batch 8 --seq 1024
    python bench/compile_time.py --device cuda --modes per_block --batch 8,16,32 --seq 1024 --head fused --optimizer

Modes:
  whole      torch.compile(model): what train.py once did, one graph for the whole model; measured
             at the first --batch only, for the comparison
  per_block  model.compile_per_block() and headloss.compiled_head_loss(), what train.py does now: each block
             compiled on its own and the head's per-chunk loss math, the embeddings and the head's matmuls eager.
             Blocks of one structure share a graph, so compiling does not grow with depth.
Every row is a fresh process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in a new
temporary folder, the FX-graph and AOT-autograd caches off), so its first step pays all of compilation, as the
event's first step does. Before compiling, each process runs one eager forward+backward on the same weights and
tokens: the reference the compiled first step must match (zero_init_proj off, so blocks are not identities; the
graph is the same), and the warm-up of everything that is not compilation, alike for both modes.
A step is one forward+backward on random tokens (32K vocabulary), through the (B, T, V) logits and F.cross_entropy
(--head logits: model(idx, targets)) or the chunked head + loss train.py uses (--head fused: model(idx, targets,
loss_fn=head_loss)). The steady step is the median of --steps more after one untimed; tokens/s and MFU come from
it (MFU against the GPU's published bf16 peak; none on CPU). With --optimizer, optimizers.build_optimizers' Muon + AdamW
step after each and are timed on their own: in one process Muon orthogonalises every matrix, W times what a rank
of W does. CUDA runs in bf16 autocast, as train.py does.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import get_model
from headloss import compiled_head_loss, head_loss
from optimizers import build_optimizers
from plan import peak_flops

SHAPES = {  # l8w64: a smoke test deep enough for blocks with and without value embeddings
    "l8w64": {"n_layer": 8, "n_head": 2, "n_embd": 64},
    "l12w768": {"n_layer": 12, "n_head": 6, "n_embd": 768},
    "l16w1024": {"n_layer": 16, "n_head": 8, "n_embd": 1024},
}
VOCAB = 32000
LOSS_TOL = {"cpu": 1e-4, "cuda": 2e-2}  # |compiled - eager| / eager: fp32 on CPU, bf16 autocast on CUDA
# worst parameter's |g_compiled - g_eager| / |g_eager|: a wrong graph is off by O(1); reordered float sums reach
# ~1e-3 in fp32 on the scalar gains, whose gradients are sums with much cancellation
GRAD_TOL = {"cpu": 1e-2, "cuda": 1e-1}


def measure(mode, shape, batch, seq, device, steps, optimizer, head):
    """One row, in this (fresh) process."""
    from torch._dynamo.utils import counters

    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = get_model({"vocab_size": VOCAB, "seq_len": seq, **SHAPES[shape], "zero_init_proj": False}).to(device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    x, y = torch.randint(0, VOCAB, (2, batch, seq), device=device)

    loss_fn = head_loss if head == "fused" else None

    def forward_backward(m):
        with amp:
            _, loss = m(x, y, loss_fn=loss_fn)
        loss.backward()
        return loss.detach()

    eager_loss = forward_backward(model).item()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    if mode == "whole":
        compiled = torch.compile(model)
    else:
        model.compile_per_block()
        compiled = model
        loss_fn = compiled_head_loss() if head == "fused" else None

    sync()
    start = time.perf_counter()
    loss = forward_backward(compiled)
    sync()
    first_s = time.perf_counter() - start
    grad_err = max(
        ((p.grad - g).norm() / g.norm().clamp(min=1e-30)).item() for p, g in zip(model.parameters(), eager_grads)
    )
    del eager_grads
    if cuda:  # the steady step's memory, not the eager reference's
        torch.cuda.reset_peak_memory_stats(device)

    optimizers = build_optimizers(model, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04) if optimizer else []
    step_s, opt_s = [], []
    for i in range(steps + 1):  # the first pass is untimed: optimizer state, allocator, a second backward
        compiled.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        forward_backward(compiled)
        sync()
        t1 = time.perf_counter()
        for opt in optimizers:
            opt.step()
        sync()
        if i > 0:
            step_s.append(t1 - t0)
            opt_s.append(time.perf_counter() - t1)
    step = statistics.median(step_s)
    tokens_per_s = batch * seq / step
    peak = peak_flops(device)
    return {
        "mode": mode,
        "shape": shape,
        "batch": batch,
        "seq": seq,
        "device": device.type,
        "first_s": first_s,
        "step_ms": 1e3 * step,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * model.flops_per_token(seq) / peak if peak else None,
        "opt_ms": 1e3 * statistics.median(opt_s) if optimizer else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "graphs": counters["stats"]["unique_graphs"],
        "loss_eager": eager_loss,
        "loss_compiled": loss.item(),
        "grad_err": grad_err,
        "orig_mod_keys": any("_orig_mod" in k for k in compiled.state_dict()),
    }


def run_fresh(args, mode, shape, batch):
    """measure() in a new process with an empty compile cache: the row, or an error string."""
    spec = {
        "mode": mode,
        "shape": shape,
        "batch": batch,
        "seq": args.seq,
        "device": args.device,
        "steps": args.steps,
        "optimizer": args.optimizer,
        "head": args.head,
    }
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
            "TRITON_CACHE_DIR": f"{cache}/triton",
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            "OMP_NUM_THREADS": str(args.threads),
        }
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                check=False,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {args.timeout} s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"failed (exit {proc.returncode}): {last}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checks(row):
    """(loss and gradients match eager, the state_dict is plain): the per_block facts this script asserts."""
    kind = row["device"]
    loss_ok = abs(row["loss_compiled"] - row["loss_eager"]) <= LOSS_TOL[kind] * abs(row["loss_eager"])
    return loss_ok and row["grad_err"] <= GRAD_TOL[kind], not row["orig_mod_keys"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--modes", default="whole,per_block", help="comma-separated: whole, per_block")
    parser.add_argument("--shapes", default="l12w768,l16w1024", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--batch", default="1", help="comma-separated micro-batches (sequences); whole: the first")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (compile time barely depends on it)")
    parser.add_argument("--steps", type=int, default=3, help="timed steady steps after the first")
    parser.add_argument("--head", default="logits", choices=["logits", "fused"], help="the head + loss path")
    parser.add_argument("--optimizer", action="store_true", help="step Muon + AdamW after each step and time it")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each measuring process")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(**json.loads(args.worker))))
        return
    modes, shapes = args.modes.split(","), args.shapes.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    if bad := [m for m in modes if m not in ("whole", "per_block")] + [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown mode or shape: {', '.join(bad)}")

    print(f"{args.device}, {args.threads} thread(s) per process, head {args.head}, an empty compile cache per row\n")
    print(
        "| mode | shape | tokens | first step s | steady ms | tokens/s | MFU | optimizer ms | peak GiB | graphs | "
        "loss eager / compiled | grad rel err | `_orig_mod` keys |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows, failed = {}, False
    for shape in shapes:
        for batch in batches:
            for mode in modes:
                if mode == "whole" and batch != batches[0]:
                    continue  # the old way is there for the compile-time comparison: one micro-batch is enough
                row = run_fresh(args, mode, shape, batch)
                label = f"| {mode} | {shape} | {batch} x {args.seq} |"
                if isinstance(row, str):
                    print(f"{label} {row} |", flush=True)
                    failed = True
                    continue
                rows[mode, shape, batch] = row
                optional = [
                    f"{row['mfu']:.1%}" if row["mfu"] is not None else "-",
                    f"{row['opt_ms']:,.1f}" if row["opt_ms"] is not None else "-",
                    f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "-",
                ]
                print(
                    f"{label} {row['first_s']:.1f} | {row['step_ms']:,.1f} | {row['tokens_per_s']:,.0f} | "
                    f"{' | '.join(optional)} | {row['graphs']} | {row['loss_eager']:.5f} / "
                    f"{row['loss_compiled']:.5f} | {row['grad_err']:.1e} | {row['orig_mod_keys']} |",
                    flush=True,
                )

    print()
    for (mode, shape, batch), row in rows.items():
        if mode == "per_block":
            matches, plain = checks(row)
            failed |= not (matches and plain)
            print(
                f"per_block {shape} {batch} x {args.seq}: loss and gradients {'match' if matches else 'DIFFER FROM'} "
                f"eager (loss tolerance {LOSS_TOL[args.device]:g} relative, gradients {GRAD_TOL[args.device]:g}); "
                f"state_dict keys {'have no' if plain else 'HAVE'} _orig_mod prefix"
            )
        if mode == "whole" and ("per_block", shape, batch) in rows:
            ratio = row["first_s"] / rows["per_block", shape, batch]["first_s"]
            print(f"{shape} {batch} x {args.seq}: the per-block first step is {ratio:.2f}x faster than whole-model")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

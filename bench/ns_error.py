"""How close each Newton-Schulz coefficient set gets to the orthogonal polar factor, iteration by iteration, on the
directions Muon really orthogonalises (the Nesterov momentum of every hidden matrix after a few training steps).

    python bench/ns_error.py                          # l4w128 on the bench corpus, 20 steps, both sets
    python bench/ns_error.py --steps 40 --n_embd 256 --corpus DIR

For each set (muon.NS_COEFFS) and iteration k = 1..5 it prints, over all hidden matrices: the mean relative error
||X_k - U V^T||_F / ||U V^T||_F (U V^T from an SVD in float64), and the smallest and largest singular value of X_k
(1 is the target), and the share of all singular values within [0.7, 1.3]. A gradient's smallest singular values
are near 0 and no 5-step polynomial lifts them, so the smallest value says little. float32 on CPU, as Muon
computes there.
"""

import argparse
import os
import pathlib
import sys

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from model import get_model  # noqa: E402
from muon import NS_COEFFS, Muon, zeropower_via_newtonschulz  # noqa: E402
from optimizers import build_optimizers  # noqa: E402


def real_directions(args):
    """Train a few steps with the default recipe; return the Muon update directions of the last step."""
    torch.manual_seed(0)
    tokens = np.fromfile(pathlib.Path(args.corpus, "chunk_0000.bin"), dtype="<u2").astype(np.int64)
    model = get_model(
        {"vocab_size": 32000, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": 4, "seq_len": args.seq_len}
    )
    opts = build_optimizers(model, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    muon = next(o for o in opts if isinstance(o, Muon))
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        starts = rng.integers(0, len(tokens) - args.seq_len - 1, size=args.batch)
        window = torch.from_numpy(np.stack([tokens[s : s + args.seq_len + 1] for s in starts]))
        _, loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        for opt in opts:
            opt.step()
        # what this step orthogonalised: the gradient and the momentum buffer it was just folded into
        directions = [muon._direction(p, muon.param_groups[0]) for p in muon.param_groups[0]["params"]]
        model.zero_grad(set_to_none=True)
    print(f"{len(directions)} hidden matrices after {args.steps} steps (loss {loss.item():.3f})")
    return [d.detach().clone() for d in directions]


def per_iteration(G, coeffs, steps):
    """[(relative error, smallest sv, largest sv, svs in [0.7, 1.3], svs)] after iterations 1..steps. Iterating k
    steps from scratch is the same computation as stopping the loop after k (each polynomial depends on its index)."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    rows = []
    for k in range(1, steps + 1):
        X = zeropower_via_newtonschulz(G, k, coeffs).double()
        s = torch.linalg.svdvals(X)
        error = ((X - polar).norm() / polar.norm()).item()
        rows.append((error, s.min().item(), s.max().item(), ((s > 0.7) & (s < 1.3)).sum().item(), s.numel()))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=os.environ.get("BENCH_CORPUS", str(REPO.parent / "bench_corpus")))
    parser.add_argument("--steps", type=int, default=20, help="training steps before the directions are taken")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ns_steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    directions = real_directions(args)
    print("| coefficients | iteration | mean relative error to U V^T | smallest sv | largest sv | sv in [0.7, 1.3] |")
    print("|---|---|---|---|---|---|")
    for coeffs in NS_COEFFS:
        stats = [per_iteration(G, coeffs, args.ns_steps) for G in directions]
        for k in range(args.ns_steps):
            err = np.mean([s[k][0] for s in stats])
            lo, hi = min(s[k][1] for s in stats), max(s[k][2] for s in stats)
            share = sum(s[k][3] for s in stats) / sum(s[k][4] for s in stats)
            print(f"| {coeffs} | {k + 1} | {err:.4f} | {lo:.3f} | {hi:.3f} | {share:.1%} |")


if __name__ == "__main__":
    main()

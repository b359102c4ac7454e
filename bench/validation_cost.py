"""What a validation batch costs two ways, side by side in one process: through the compiled training graphs (grad
mode on, the training shape: no new graph, but autograd state is kept and the head's gradients are taken in
forward) or eagerly without autograd (torch.compiler.set_stance("force_eager"), what train.evaluate does: no
graph of its own whatever the batch shape). The training step is timed too, for scale.

    python bench/validation_cost.py                      # l16w128, 8 x 128 tokens, 32K vocabulary, 1 thread
    python bench/validation_cost.py --n_embd 256 --rounds 7
"""

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from model import get_model
from headloss import compiled_head_loss, head_loss


def best_of(fn, rounds):
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=16)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--n_head", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head}
    model = get_model({"vocab_size": 32000, "seq_len": args.seq, **shape})
    model.compile_per_block()
    compiled_loss = compiled_head_loss()
    x, y = (torch.randint(0, 32000, (args.batch, args.seq)) for _ in range(2))

    def train_step():
        model(x, y, loss_fn=compiled_loss)[1].backward()

    def compiled_grad_mode():
        model(x, y, loss_fn=compiled_loss)[1].item()

    def eager_no_grad():
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            model(x, y, loss_fn=head_loss)[1].item()

    start = time.perf_counter()
    train_step()
    print(f"l{args.n_layer}w{args.n_embd}, {args.batch} x {args.seq} tokens, {args.threads} thread(s)")
    print(f"first step (compiles): {time.perf_counter() - start:.1f} s")
    timed = {name: best_of(fn, args.rounds) for name, fn in [("train", train_step), ("compiled", compiled_grad_mode)]}
    timed["eager"] = best_of(eager_no_grad, args.rounds)
    print(
        "| training step ms | validation batch: compiled graphs, grad on, ms | eager, no grad, ms | eager / compiled |"
    )
    print("| --- | --- | --- | --- |")
    print(
        f"| {timed['train'] * 1e3:,.0f} | {timed['compiled'] * 1e3:,.0f} | {timed['eager'] * 1e3:,.0f} | "
        f"{timed['eager'] / timed['compiled']:.2f} |"
    )


if __name__ == "__main__":
    main()

"""Step cost of model.py switches relative to the default: one training step (forward, backward through the chunked
head, Muon + AdamW) per variant, the variants interleaved round-robin so that a shared machine's noise hits all alike.

    python bench/step_cost.py                                   # l4w128, T 256, micro-batch 8, vocab 32000
    python bench/step_cost.py --variants "bigram_mult=5;backout=1" --reps 15
    python bench/step_cost.py --shape 8,128,4 --variants "normuon_beta2=0.95;normuon_beta2=0.95,snoo=1"

Optimizer options beside the switches: normuon_beta2=B, update_smoothing=S (Muon), snoo=K (Snoo at the record's LR
0.68 and momentum 0.37, an outer step every K steps; K=1: every timed step pays one, the cost of each).

Prints each variant's median and minimum step time and their ratios to the first variant's (the default before the
record's bigram table, backout and value-embedding gate, unless given).
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from model import GPTConfig, get_model  # noqa: E402
from headloss import head_loss  # noqa: E402
from optimizers import build_optimizers  # noqa: E402

BEFORE = "bigram_mult=0,backout=0,ve_gate=0"  # before the record's switches; "default": them adopted
VARIANTS = ";".join(
    [BEFORE]
    + [f"{BEFORE},{s}" for s in ("bigram_mult=5", "smear=1", "attn_gate=1", "ve_gate=1", "backout=1")]
    + [f"{BEFORE},untie_at=0.667", "default"]
)


OPTIMIZER = {"normuon_beta2": float, "update_smoothing": float, "snoo": int}


def parse(spec):
    """'key=value,key=value' -> (model switches, optimizer options), each value in its type ('default': none)."""
    types = {f.name: f.type for f in GPTConfig.__dataclass_fields__.values()}
    switches, options = {}, {}
    for item in filter(None, spec.split(",")):
        if item == "default":
            continue
        key, value = item.split("=")
        if key in OPTIMIZER:
            options[key] = OPTIMIZER[key](value)
        else:
            switches[key] = bool(int(value)) if types[key] is bool else types[key](value)
    if "snoo" in options:
        options["snoo"] = (0.68, 0.37, options["snoo"])
    return switches, options


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=VARIANTS, help="';'-separated variants, each 'key=value,...'")
    parser.add_argument("--shape", default="4,128,4", help="n_layer,n_embd,n_head")
    parser.add_argument("--batch", default="8,256", help="micro-batch,seq_len")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L, C, H = map(int, args.shape.split(","))
    B, T = map(int, args.batch.split(","))
    runs = []
    for spec in args.variants.split(";"):
        torch.manual_seed(0)
        switches, options = parse(spec)
        model = get_model({"n_layer": L, "n_embd": C, "n_head": H, "vocab_size": 32000, "seq_len": T, **switches})
        opts = build_optimizers(model, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04, **options)
        runs.append((spec, model, opts, []))
    x = torch.randint(0, 32000, (B, T + 1), generator=torch.Generator().manual_seed(0))
    for rep in range(args.reps + 1):
        for spec, model, opts, times in runs:
            start = time.perf_counter()
            model.set_progress(0.5)
            model(x[:, :-1], x[:, 1:], loss_fn=head_loss)[1].backward()
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
            if rep:  # the first step warms the allocator and creates the optimizer state
                times.append(time.perf_counter() - start)
    base = statistics.median(runs[0][3])
    best = min(runs[0][3])
    print(f"{'variant':<62} {'params':>11} {'median ms':>9} {'ratio':>6} {'min ms':>8} {'ratio':>6}")
    for spec, model, _, times in runs:  # the minimum: the step least disturbed by the machine's other work
        ms, low = statistics.median(times), min(times)
        print(
            f"{spec:<62} {model.num_params():>11,} {1e3 * ms:9.1f} {ms / base:6.3f} {1e3 * low:8.1f} {low / best:6.3f}"
        )


if __name__ == "__main__":
    main()

"""Optimizer settings at FIXED STEPS on the bench corpus: LRs across widths, the batch rule, the record's settings.

    python bench/lr_sweep.py --sweep record              # today's default vs each of the record's settings, 3 seeds
    python bench/lr_sweep.py --sweep batch               # sqrt LR rule: all groups / Adam only / none, 4x batch
    python bench/lr_sweep.py --sweep width --seeds 1     # Muon LR x0.25-x2, embedding LR x0.5 / x2, widths 64-384
    python bench/lr_sweep.py --sweep near_free           # NorMuon and the tail EMA, each and together
    python bench/lr_sweep.py --sweep dense --steps 200   # MUDD, Snoo, update smoothing at l8w128, each and together
    python bench/lr_sweep.py --sweep record --lanes 2 --steps 100 --out runs/lr_sweep

Every run is one train.py on the bench corpus (../shared/bench/setup.sh builds it) with --progress_by steps and a
fixed --batch_tokens, so the schedule, the steps and the tokens are the same whatever the (shared, noisy) CPU does;
the budget is far away and never binds. Scored by the run's own final validation on val.bin (the same windows for
every run, --val_eval_tokens of them). Lanes run side by side, one torch thread each. The table gives each seed's
loss, the mean, the mean's difference from the sweep's first variant and the seeds' spread (max - min).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parent.parent
MIN_BATCH = 2048  # plan.MIN_TOKENS_PER_STEP["cpu"]: micro-batch 8 x 256


def shape(width, layers=4):
    return f"--n_layer {layers} --n_embd {width} --n_head {max(width // 32, 2)} --seq_len 256 --micro_batch 8"


RECORD = {  # modded-nanogpt's medium track (16 x 1024, the event's shape), each against today's default alone
    "default": "",
    "wd_cautious": "--muon_weight_decay 1.2 --adam_weight_decay 0.005",
    "cooldown_0.7": "--decay_frac 0.7",
    "floor_0.15": "--min_lr_frac 0.15",
    "polar_express": "--ns_coeffs polar_express",
}
NEAR_FREE = {  # the record's near-free optimizer items, each against the default with them off
    "default": "--normuon_beta2 0 --tail_ema 0",
    "normuon": "--normuon_beta2 0.95 --tail_ema 0",
    "tail_ema": "--normuon_beta2 0 --tail_ema 0.6",
    "both": "--normuon_beta2 0.95 --tail_ema 0.6",
}


DENSE = {  # the medium track's open wins, each against the default with all three off (l8w128: "the last two of 8")
    "all_off": "--mudd false --snoo_lr 0 --muon_smoothing 0",
    "mudd": "--mudd --snoo_lr 0 --muon_smoothing 0",
    "snoo": "--mudd false --snoo_lr 0.68 --muon_smoothing 0",
    "smoothing": "--mudd false --snoo_lr 0 --muon_smoothing 0.2",
    "all_three": "--mudd --snoo_lr 0.68 --muon_smoothing 0.2",
}


def sweeps(args):
    """{sweep: {variant: (flags, seeds)}}."""
    width_lr = {}
    for width in (64, 128, 256, 384):
        base = shape(width)
        for factor in (0.25, 0.5, 1, 2):
            width_lr[f"w{width}_muon_x{factor}"] = f"{base} --muon_lr {0.05 * factor:g}"
        for factor in (0.5, 2):
            width_lr[f"w{width}_embed_x{factor}"] = f"{base} --embed_lr {0.6 * factor:g}"
    batch = {  # 4x the CPU minimum batch: the ratio the event's step cap forces (4.9x)
        f"4x_{rule}": f"{shape(128)} --batch_tokens {4 * MIN_BATCH} --lr_rule {rule}"
        for rule in ("sqrt", "sqrt_adam", "none")
    }
    batch["4x_sqrt_warmup"] = f"{shape(128)} --batch_tokens {4 * MIN_BATCH} --lr_rule sqrt --warmup_frac 0.05"
    record = {name: f"{shape(128)} {flags}" for name, flags in RECORD.items()}
    record["all_record"] = f"{shape(128)} {' '.join(RECORD.values())}"
    combined = {"default": shape(128), "chosen": f"{shape(128)} {args.chosen}"}
    near_free = {name: f"{shape(128)} {flags}" for name, flags in NEAR_FREE.items()}
    dense = {name: f"{shape(128, layers=8)} {flags}" for name, flags in DENSE.items()}
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    return {
        "width": {k: (v, seeds) for k, v in width_lr.items()},
        "batch": {k: (v, seeds) for k, v in batch.items()},
        "record": {k: (v, seeds) for k, v in record.items()},
        "combined": {k: (v, seeds) for k, v in combined.items()},
        "near_free": {k: (v, seeds) for k, v in near_free.items()},
        "dense": {k: (v, seeds) for k, v in dense.items()},
    }


def run(name, flags, seed, args, out):
    folder = out / f"{name}_seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    steps = args.steps // 4 if "--batch_tokens" in flags else args.steps  # the 4x batch: the same tokens
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        *f"--data_dir {args.corpus} --val_file {args.corpus}/val.bin".split(),
        *f"--checkpoint_path {folder / 'checkpoint.pt'}".split(),
        *f"--time_limit_min 120 --max_steps {steps} --progress_by steps --batch_tokens {MIN_BATCH}".split(),
        *f"--val_eval_tokens {args.eval_tokens} --save_every_min 0 --seed {seed}".split(),
        *flags.split(),
        *args.extra.split(),
    ]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (folder / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"name": name, "seed": seed, "error": f"exit {proc.returncode}, see {folder / 'train.log'}"}
    summary = json.loads((folder / "metrics.jsonl").read_text().strip().splitlines()[-1])
    (folder / "checkpoint.pt").unlink(missing_ok=True)  # the numbers are what is kept
    return {
        "name": name,
        "seed": seed,
        "flags": flags,
        "val_loss": summary["val_loss"],
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "train_s": summary["train_s"],
        "wall_s": round(time.time() - started, 1),
    }


def table(results):
    """Markdown: variant, each seed's loss, mean, vs the first variant, spread."""
    by_name = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    lines, base = [], None
    nseeds = max(len(rs) for rs in by_name.values())
    head = " | ".join(f"seed {i}" for i in range(nseeds))
    lines += [f"| variant | {head} | mean | vs first | spread | steps x tokens |", "|---" * (nseeds + 5) + "|"]
    for name, rs in by_name.items():
        ok = [r for r in sorted(rs, key=lambda r: r["seed"]) if "error" not in r]
        if not ok:
            lines.append(f"| {name} | {rs[0]['error']} |")
            continue
        losses = [r["val_loss"] for r in ok]
        mean = sum(losses) / len(losses)
        base = mean if base is None else base
        cells = " | ".join(f"{v:.4f}" for v in losses) + " |" * (nseeds - len(losses))
        lines.append(
            f"| {name} | {cells} | {mean:.4f} | {mean - base:+.4f} | {max(losses) - min(losses):.4f} "
            f"| {ok[0]['steps']} x {ok[0]['tokens'] // ok[0]['steps']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep_names = ("width", "batch", "record", "combined", "near_free", "dense")
    parser.add_argument("--sweep", required=True, choices=sweep_names)
    parser.add_argument("--variants", default="all", help="comma list of the sweep's variants")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps at the minimum batch (4x batch: /4)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first_seed", type=int, default=0, help="seeds first_seed .. first_seed + seeds - 1")
    parser.add_argument("--lanes", type=int, default=2, help="runs side by side, one torch thread each")
    parser.add_argument("--eval_tokens", type=int, default=32768, help="val.bin tokens of the final validation")
    parser.add_argument("--chosen", default="", help="combined sweep: the flags of the chosen recipe")
    parser.add_argument("--extra", default="", help="flags added to every run (e.g. --log_every_s 30)")
    parser.add_argument("--corpus", default=os.environ.get("BENCH_CORPUS", str(REPO.parent / "bench_corpus")))
    parser.add_argument("--out", default="runs/lr_sweep")
    args = parser.parse_args()
    if not pathlib.Path(args.corpus, "val.bin").is_file():
        parser.error(f"no bench corpus at {args.corpus}: build it with ../shared/bench/setup.sh DIR, pass --corpus DIR")
    variants = sweeps(args)[args.sweep]
    if args.variants != "all":
        variants = {k: variants[k] for k in args.variants.split(",")}
    out = pathlib.Path(args.out) / args.sweep
    out.mkdir(parents=True, exist_ok=True)
    every = range(args.first_seed, args.first_seed + args.seeds)
    jobs = [(name, flags, seed) for seed in every for name, (flags, seeds) in variants.items() if seed in seeds]
    started = time.time()
    with ThreadPoolExecutor(args.lanes) as pool:
        results = list(pool.map(lambda job: run(*job, args, out), jobs))
    for r in results:
        print(json.dumps(r), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"{len(jobs)} runs in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()

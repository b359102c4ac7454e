"""The recipe under the organizers' step cap: the variants' table and plot, from speedrun.py runs.

    # two streams side by side, one core each (BENCHMARKS.md has the exact lanes used)
    taskset -c 0 python bench/speedrun.py --budget_min 5 --variants cap_none_seed0,cap_forced_seed0,... --out A
    taskset -c 1 python bench/speedrun.py --budget_min 5 --variants cap_forced_sqrt_lr_seed0,... --out B
    python bench/step_cap.py A B --out step_cap.png

Per variant: the mean and spread (max - min) over seeds of the final score (eval.py on the checkpoint), steps, tokens
per step at the end and tokens trained; the plot draws each variant's periodic validation loss against tokens, the
mean over seeds at each validation, ending at the mean final score.
"""

import argparse
import json
import pathlib
import statistics

VARIANTS = {  # speedrun.py's names, in the table's order
    "cap_none": "(a) no binding cap: the recipe's batch",
    "cap_forced": "(b) the cap's forced batch, constant",
    "cap_forced_sqrt_lr": "(c) forced batch, LRs x sqrt(batch ratio)",
}


def load(dirs):
    """{variant: [run, ...]}: each run's final score, summary and validation rows, from speedrun.py's folders."""
    runs = {name: [] for name in VARIANTS}
    for folder in map(pathlib.Path, dirs):
        for result in json.loads((folder / "results.json").read_text())["results"]:
            variant = result["name"].rsplit("_seed", 1)[0]
            if variant not in runs or "error" in result:
                continue
            rows = [json.loads(line) for line in (folder / result["name"] / "metrics.jsonl").read_text().splitlines()]
            runs[variant].append(
                {
                    "score": result["val_loss"],
                    "summary": rows[-1],
                    "vals": [r for r in rows[:-2] if "val_loss" in r],  # periodic ones; the last two are the final
                }
            )
    return runs


def final_tokens_per_step(summary):
    plan = summary["plan"]
    return plan["tokens_per_step"] // plan["grad_accum_steps"] * summary["grad_accum_steps"]


def table(runs):
    lines = [
        "| variant | seeds | val loss mean | spread | steps | tokens/step at the end | tokens trained |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in VARIANTS.items():
        if not runs[name]:
            continue
        scores = [r["score"] for r in runs[name]]
        steps = "/".join(str(r["summary"]["steps"]) for r in runs[name])
        per_step = "/".join(f"{final_tokens_per_step(r['summary']):,}" for r in runs[name])
        tokens = statistics.mean(r["summary"]["tokens"] for r in runs[name])
        lines.append(
            f"| {label} | {len(scores)} | {statistics.mean(scores):.3f} | {max(scores) - min(scores):.3f} | {steps} | "
            f"{per_step} | {tokens:,.0f} |"
        )
    return "\n".join(lines)


def plot(runs, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, label in VARIANTS.items():
        if not runs[name]:
            continue
        count = min(len(r["vals"]) for r in runs[name])
        tokens = [statistics.mean(r["vals"][i]["tokens"] for r in runs[name]) for i in range(count)]
        losses = [statistics.mean(r["vals"][i]["val_loss"] for r in runs[name]) for i in range(count)]
        tokens.append(statistics.mean(r["summary"]["tokens"] for r in runs[name]))
        losses.append(statistics.mean(r["score"] for r in runs[name]))
        ax.plot(tokens, losses, marker="o", label=label)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation loss (mean over seeds; last point: eval.py's final score)")
    ax.set_title("5-minute CPU runs under a step cap that forces 4-5x the recipe's batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="speedrun.py --out folders")
    parser.add_argument("--out", default="step_cap.png", help="the plot")
    args = parser.parse_args()
    runs = load(args.dirs)
    print(table(runs))
    plot(runs, args.out)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()

"""Training curves of one or more runs from the metrics.jsonl files train.py writes, as one PNG.

    python plot.py runs/a runs/b --out curves.png          # RUN_DIR means RUN_DIR/metrics.jsonl
    python plot.py runs/speedrun/*/metrics.jsonl --out sweep.png

Four panels, one colour per run: train loss (line) and validation loss (dots) against wall-clock seconds and
against tokens, the LR fraction, and tokens/s. A run is named by its folder (or by the file's stem when it is
not called metrics.jsonl). The summary row's facts (shape, parameters, budget) go in the title when every run
shares them, else beside the run's name in the legend, with its final validation loss. The loss axes leave out
the first few percent of rows, whose loss is far above the rest, so the differences at the end stay visible.

matplotlib is optional (pip install -e ".[plot]") and imported only here.
"""

import argparse
import json
import math
import pathlib
import sys
from typing import Any, NoReturn

# train.py's training row
TRAIN_KEYS: tuple[str, ...] = ("step", "elapsed_s", "lr_frac", "train_loss", "tokens", "tokens_per_s")
VAL_KEYS = ("step", "val_loss")  # a validation row; its elapsed_s and tokens, when there, are drawn too


def finite_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fail(message) -> NoReturn:
    """Exit status 2 with one sentence on stderr; the SystemExit carries the sentence too, for callers of main."""
    print(f"error: {message}", file=sys.stderr)
    error = SystemExit(f"error: {message}")
    error.code = 2
    raise error


class OneSentenceParser(argparse.ArgumentParser):
    """argparse whose error (a flag it cannot read) is fail's one sentence; --help still shows the usage."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def metrics_file(path):
    path = pathlib.Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist.")
    return path


def load_run(path):
    """{"name", "train": [rows], "val": [rows], "summary": row or None} from a run folder or metrics file."""
    path = metrics_file(path)
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file of JSON lines.") from None
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number < last:  # only the last line may be cut off, by a run still writing it
                raise ValueError(f"{path} line {number} is not JSON.") from None
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number} is not a JSON object.")
        if "train_loss" in row:
            kind, keys = "training", TRAIN_KEYS
        elif "val_loss" in row and not row.get("summary"):
            kind, keys = "validation", VAL_KEYS + tuple(key for key in ("elapsed_s", "tokens") if key in row)
        else:  # the summary, a row saying why a run stopped, ...: no point on a curve
            kind, keys = None, ()
        if missing := [key for key in keys if not finite_number(row.get(key))]:
            raise ValueError(
                f"{path} line {number} is a {kind} row without a finite number under {', '.join(missing)}."
            )
        rows.append(row)
    train = [r for r in rows if "train_loss" in r]
    val = [r for r in rows if "val_loss" in r and not r.get("summary")]
    summary = next((r for r in rows if r.get("summary")), None)
    if not train and not val:
        raise ValueError(f"{path} holds no training or validation rows to plot.")
    # validation rows carry no token count; every step consumes the same number of tokens
    per_step = next((r["tokens"] / r["step"] for r in reversed(train) if r.get("step")), None)
    for row in val:
        if "tokens" not in row and per_step is not None:
            row["tokens"] = row["step"] * per_step
    name = path.parent.name if path.name == "metrics.jsonl" else path.stem
    return {"name": name or str(path), "train": train, "val": val, "summary": summary}


def run_facts(summary):
    """Shape, parameters and budget from a summary row, its "plan" and its "config", whichever hold them."""
    summary = summary or {}
    sources = [s for s in (summary, summary.get("plan"), summary.get("config")) if isinstance(s, dict)]

    def find(*keys, kind=finite_number):  # a value of another kind is no fact, not an error: the curves stand alone
        return next((s[k] for k in keys for s in sources if kind(s.get(k))), None)

    facts = {}
    n_layer, n_embd, model = find("n_layer"), find("n_embd"), find("model", kind=lambda v: isinstance(v, str))
    if n_layer and n_embd:
        facts["shape"] = f"l{n_layer}w{n_embd}"
    elif isinstance(model, str) and model != "auto":
        facts["shape"] = model
    if params := find("params", "n_params"):
        facts["params"] = f"{params / 1e6:.3g}M params"
    if (minutes := find("time_limit_min")) is not None:
        facts["budget"] = f"{minutes:g} min budget"
    elif (seconds := find("train_s")) is not None:
        facts["budget"] = f"{seconds:.0f} s trained"
    return facts


def loss_limits(runs):
    """(bottom, top) of the loss axes: the lowest loss; the 95th percentile of train losses or the top val loss."""
    train = sorted(r["train_loss"] for run in runs for r in run["train"])
    losses = train + [r["val_loss"] for run in runs for r in run["val"]]
    if not losses:
        return None
    low, high = min(losses), max(losses)
    top = train[int(0.95 * (len(train) - 1))] if train else high
    top = max(top, max((r["val_loss"] for run in runs for r in run["val"]), default=top), low + 1e-3)
    margin = 0.05 * (top - low)
    return low - margin, min(top, high) + margin


# how a validation point looks, in the plot and in its legend
VAL_STYLE: dict[str, Any] = dict(marker="o", markersize=6, markeredgecolor="black", linestyle=":")


def check_out(out, paths):
    """--out must name a PNG to write in a folder that exists, and none of the inputs (compared by identity: a hard
    link or another path to an input is that input)."""
    if str(out) == "":
        raise ValueError("--out is empty; give the PNG to write, e.g. --out curves.png.")
    if pathlib.Path(out).is_dir():
        raise ValueError(
            f"--out {out} is a folder; give the PNG to write, e.g. --out {pathlib.Path(out, 'curves.png')}."
        )
    if not pathlib.Path(out).parent.is_dir():
        raise ValueError(f"--out {out}: the folder {pathlib.Path(out).parent} does not exist.")
    for path in paths:
        if pathlib.Path(out).exists() and metrics_file(path).samefile(out):
            raise ValueError(f"--out {out} is the metrics file {metrics_file(path)}; writing it would destroy it.")


def draw_run(axes, run, colour):
    """One run's train and validation losses against time and tokens, its LR and its throughput."""
    by_time, by_tokens, lr, speed = axes
    train, val = run["train"], run["val"]
    for ax, x in ((by_time, "elapsed_s"), (by_tokens, "tokens")):
        ax.plot([r[x] for r in train], [r["train_loss"] for r in train], color=colour, linewidth=1.2)
        points = [r for r in val if x in r]
        ax.plot(
            [r[x] for r in points],
            [r["val_loss"] for r in points],
            color=colour,
            markeredgewidth=0.6,
            linewidth=1,
            zorder=3,
            **VAL_STYLE,
        )
    lr.plot([r["elapsed_s"] for r in train], [r["lr_frac"] for r in train], color=colour, linewidth=1.2)
    speed.plot([r["elapsed_s"] for r in train], [r["tokens_per_s"] for r in train], color=colour, linewidth=1.2)


def label_axes(axes, limits, eng_formatter):
    by_time, by_tokens, lr, speed = axes
    for ax in (by_time, by_tokens):
        ax.set_ylabel("loss (nats/token)")
        if limits:
            ax.set_ylim(*limits)
    by_time.set_title("loss against wall-clock time")
    by_tokens.set_title("loss against tokens seen")
    lr.set_title("learning rate")
    speed.set_title("throughput")
    for ax in (by_time, lr, speed):
        ax.set_xlabel("seconds since the first step")
    by_tokens.set_xlabel("tokens")
    by_tokens.xaxis.set_major_formatter(eng_formatter())
    lr.set_ylabel("LR / peak LR")
    lr.set_ylim(-0.03, 1.05)
    speed.set_ylabel("tokens/s")
    speed.yaxis.set_major_formatter(eng_formatter())
    speed.set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)


def plot_runs(paths, out):
    """Draw the runs' curves into the PNG at out; returns the figure."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import EngFormatter
    except ImportError:
        raise ImportError('plot.py needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)') from None
    check_out(out, paths)
    runs = [load_run(path) for path in paths]
    if not runs:
        raise ValueError("no runs to plot.")
    facts = [run_facts(run["summary"]) for run in runs]
    shared = {k: v for k, v in facts[0].items() if all(f.get(k) == v for f in facts)}
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    (by_time, by_tokens), (lr, speed) = fig.subplots(2, 2)
    axes = (by_time, by_tokens, lr, speed)
    colours = colormaps["tab10" if len(runs) <= 10 else "tab20"]
    handles = []
    for i, (run, facts_i) in enumerate(zip(runs, facts)):
        colour = colours(i % colours.N)
        label = ", ".join([v for k, v in facts_i.items() if k not in shared])
        final = (run["summary"] or {}).get("val_loss")
        label = run["name"] + (f" ({label})" if label else "") + (f": val {final:.3f}" if finite_number(final) else "")
        handles.append(Line2D([], [], color=colour, linewidth=2, label=label))
        draw_run(axes, run, colour)
    label_axes(axes, loss_limits(runs), EngFormatter)
    handles += [
        Line2D([], [], color="black", linewidth=1.2, label="train loss"),
        Line2D([], [], color="grey", label="validation loss", **VAL_STYLE),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(3, len(handles)), frameon=False)
    title = ", ".join(shared.values())
    fig.suptitle(f"{len(runs)} run{'s' if len(runs) > 1 else ''}" + (f": {title}" if title else ""), fontsize=14)
    try:
        # without a suffix matplotlib would write NAME.png and the run would report NAME: write NAME, as a PNG
        fig.savefig(out, dpi=110, format=None if pathlib.Path(out).suffix else "png")
    except (ValueError, OSError) as e:  # a format matplotlib does not write, a file it may not write
        raise ValueError(f"--out {out}: {e}") from None
    return fig


def main(argv=None):
    parser = OneSentenceParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders (holding metrics.jsonl) or metrics .jsonl files")
    parser.add_argument("--out", default="curves.png", help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        plot_runs(args.runs, args.out)
    except (ValueError, OSError, ImportError) as e:  # user errors: one sentence, no traceback, exit 2 as eval.py
        fail(e)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

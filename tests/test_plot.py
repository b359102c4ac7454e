"""plot.py: metrics files in, one PNG of training curves out (never over a metrics file it reads); bench/speedrun.py
writes one beside its table."""

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import speedrun  # noqa: E402

import plot  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(path, steps=40, floor=3.0, summary=None):
    """A metrics.jsonl in train.py's format: train rows, validation rows every 10 steps, a summary row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "elapsed_s": 0.5 * step,
                "lr_frac": min(1.0, 2 * (1 - step / steps)),
                "train_loss": floor + 7.0 / step,
                "tokens": 1024 * step,
                "tokens_per_s": 2048,
            }
        )
        if step % 10 == 0:
            rows.append({"step": step, "elapsed_s": 0.5 * step, "val_loss": floor + 7.5 / step})
    if summary is not None:
        rows.append({"summary": True, "steps": steps, "tokens": 1024 * steps, "train_s": 0.5 * steps, **summary})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_run_is_a_folder_or_a_file_and_validation_rows_get_their_tokens(tmp_path):
    write_metrics(tmp_path / "run_a" / "metrics.jsonl")
    run = plot.load_run(tmp_path / "run_a")
    assert run["name"] == "run_a" and len(run["train"]) == 40 and run["summary"] is None
    assert [(r["step"], r["tokens"]) for r in run["val"]] == [(10, 10240), (20, 20480), (30, 30720), (40, 40960)]
    assert plot.load_run(write_metrics(tmp_path / "other.jsonl"))["name"] == "other"


def test_a_cut_off_last_line_is_skipped_but_a_bad_line_inside_is_an_error(tmp_path):
    path = write_metrics(tmp_path / "run" / "metrics.jsonl")
    path.write_text(path.read_text() + '{"step": 41, "elapsed_s": 20.')  # a run still writing its row
    assert len(plot.load_run(path)["train"]) == 40
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        plot.load_run(path)
    with pytest.raises(FileNotFoundError):
        plot.load_run(tmp_path / "missing")


def test_facts_come_from_the_summary_its_plan_and_its_config_whichever_has_them():
    summary = {"train_s": 61.2, "params": 8_200_000, "plan": {"model": "l4w128"}}
    assert plot.run_facts(summary) == {"shape": "l4w128", "params": "8.2M params", "budget": "61 s trained"}
    summary["config"] = {"n_layer": 6, "n_embd": 256, "time_limit_min": 1.0}
    assert plot.run_facts(summary) == {"shape": "l6w256", "params": "8.2M params", "budget": "1 min budget"}
    assert plot.run_facts({"plan": {"model": "auto", "n_params": 5e5}}) == {"params": "0.5M params"}
    assert plot.run_facts(None) == {}


@pytest.mark.slow
def test_two_runs_make_one_png_with_shared_facts_in_the_title_and_the_rest_in_the_legend(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra; CI installs it")
    from matplotlib.image import imread

    config = {"n_layer": 4, "n_embd": 128, "time_limit_min": 5}
    write_metrics(tmp_path / "default" / "metrics.jsonl", summary={"params": 8.2e6, "val_loss": 3.5, "config": config})
    write_metrics(tmp_path / "seed1.jsonl", floor=3.2, summary={"params": 9.1e6, "val_loss": 3.7, "config": config})
    out = tmp_path / "curves.png"
    plot.main([str(tmp_path / "default"), str(tmp_path / "seed1.jsonl"), "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    pixels = imread(out)
    assert pixels.shape[0] > 600 and pixels.shape[1] > 900 and pixels.std() > 0.05  # drawn, not blank
    fig = plot.plot_runs([tmp_path / "default", tmp_path / "seed1.jsonl"], tmp_path / "again.png")
    assert fig.get_suptitle() == "2 runs: l4w128, 5 min budget"
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == [
        "default (8.2M params): val 3.500",
        "seed1 (9.1M params): val 3.700",
        "train loss",
        "validation loss",
    ]
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    write_metrics(tmp_path / "default" / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[plot\]"'):
        plot.main([str(tmp_path / "default"), "--out", str(tmp_path / "curves.png")])
    speedrun.write_curves(tmp_path, ["default"])  # the benchmark still finishes, saying why there is no PNG
    assert "no curves.png written" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()


def test_speedrun_writes_its_variants_curves_beside_the_table(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra; CI installs it")
    write_metrics(tmp_path / "default" / "metrics.jsonl")
    write_metrics(tmp_path / "starter" / "metrics.jsonl", floor=3.3)
    speedrun.write_curves(tmp_path, ["default", "starter", "failed_before_any_metrics"])
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_SIGNATURE


# ----------------------------------------------------------------------------- odd files and flags

TRAIN_ROW = {"step": 1, "elapsed_s": 0.5, "lr_frac": 1.0, "train_loss": 9.0, "tokens": 1024, "tokens_per_s": 2048}
ODD_METRICS = {
    "empty.jsonl": ("", "holds no training or validation rows"),
    "blank_lines.jsonl": ("\n\n  \n", "holds no training or validation rows"),
    "only_a_cut_off_row.jsonl": ('{"step": 1, "elap', "holds no training or validation rows"),
    "summary_only.jsonl": ('{"summary": true, "params": 5}\n', "holds no training or validation rows"),
    "binary.bin": (bytes(range(128, 256)), "is not a text file of JSON lines"),
    "tokens.bin": (b"\x01\x00\x0a\x00\x02\x00" * 4, "line 1 is not JSON"),  # token 10 is a newline
    "a_list.jsonl": ("[1, 2]\n" + json.dumps(TRAIN_ROW) + "\n", "line 1 is not a JSON object"),
    "a_number.jsonl": ("\n7\n" + json.dumps(TRAIN_ROW) + "\n", "line 2 is not a JSON object"),  # blank lines count
    "lacks_keys.jsonl": ('{"step": 1, "train_loss": 3.0}\n', "line 1 is a training row without a finite number under "),
    "string_loss.jsonl": (json.dumps({**TRAIN_ROW, "train_loss": "9"}), "without a finite number under train_loss"),
    "null_loss.jsonl": (json.dumps({**TRAIN_ROW, "train_loss": None}), "without a finite number under train_loss"),
    "nan_loss.jsonl": (json.dumps({**TRAIN_ROW, "train_loss": float("nan")}), "without a finite number under"),
    "val_without_step.jsonl": ('{"val_loss": 3.0}\n', "line 1 is a validation row without a finite number under step"),
    "val_bad_tokens.jsonl": ('{"step": 1, "val_loss": 3.0, "tokens": "x"}\n', "validation row without a finite number"),
}


@pytest.mark.parametrize("name", ODD_METRICS)
def test_odd_metrics_files_are_one_sentence_naming_the_file_and_exit_2(tmp_path, capsys, name):
    text, message = ODD_METRICS[name]
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(path), "--out", str(tmp_path / "curves.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [err[0]] and err[0].startswith(f"error: {path}") and message in err[0], err
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.parametrize(
    "out, message",
    [
        ("", "--out is empty"),
        ("TMP", "--out TMP is a folder; give the PNG to write, e.g. --out TMP/curves.png"),
        ("TMP/no/such/curves.png", "--out TMP/no/such/curves.png: the folder TMP/no/such does not exist"),
        ("TMP/curves.xyz", "--out TMP/curves.xyz: Format 'xyz' is not supported"),
    ],
)
def test_odd_out_paths_are_one_sentence_and_exit_2(tmp_path, capsys, out, message):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra; CI installs it")
    write_metrics(tmp_path / "run" / "metrics.jsonl")
    with pytest.raises(SystemExit) as exit_:
        plot.main([str(tmp_path / "run"), "--out", out.replace("TMP", str(tmp_path))])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message.replace("TMP", str(tmp_path)) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_summary_values_of_another_kind_are_no_facts():
    summary = {"params": "many", "val_loss": "low", "plan": [1], "config": {"n_layer": "auto", "time_limit_min": None}}
    assert plot.run_facts(summary) == {}
    assert plot.run_facts({"model": 5, "plan": {"model": "l4w128", "train_s": float("nan")}}) == {"shape": "l4w128"}


def test_a_flag_argparse_cannot_read_is_one_sentence_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        plot.main([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: the following arguments are required: runs"]


def test_plot_out_never_overwrites_a_metrics_file_it_reads(tmp_path, capsys):
    import plot

    (tmp_path / "run").mkdir()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(json.dumps(TRAIN_ROW) + "\n")
    os.link(metrics, tmp_path / "curves.png")
    for out in (metrics, tmp_path / "curves.png"):
        with pytest.raises(SystemExit) as e:
            plot.main([str(tmp_path / "run"), "--out", str(out)])
        assert e.value.code == 2 and "would destroy it" in capsys.readouterr().err
    assert metrics.read_text() == json.dumps(TRAIN_ROW) + "\n"


def test_plot_out_without_a_suffix_writes_and_reports_that_name(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import plot

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({**TRAIN_ROW, "step": s, "elapsed_s": s / 2}) for s in (1, 2)) + "\n")
    plot.main([str(metrics), "--out", str(tmp_path / "curves")])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curves'}"
    assert (tmp_path / "curves").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png").exists()

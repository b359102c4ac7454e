"""eval.py on bad inputs: every bad checkpoint or flag is one sentence on stderr and exit status 2."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as eval_py
from model import get_model

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"vocab_size": 200, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    torch.save({"model": get_model(CONFIG).state_dict(), "config": CONFIG, "step": 3}, folder / "good.pt")
    np.random.default_rng(0).integers(0, 200, 400).astype("<u2").tofile(folder / "val.bin")
    return folder / "good.pt"


def make_bad(path, case):
    """Write the checkpoint of one case next to the good one; return its path."""
    good = path.read_bytes()
    bad = path.with_name(f"{case}.pt")
    state = get_model(CONFIG).state_dict()
    if case == "truncated":
        bad.write_bytes(good[: len(good) // 2])
    elif case == "empty":
        bad.write_bytes(b"")
    elif case == "random_bytes":
        bad.write_bytes(np.random.default_rng(1).bytes(5000))
    elif case == "wrong_shape":
        state["lm_head.weight"] = torch.zeros(3, 3)
        torch.save({"model": state, "config": CONFIG}, bad)
    elif case == "no_config":
        torch.save({"model": state, "step": 3}, bad)
    elif case == "numpy_in_config":
        torch.save({"model": state, "config": {**CONFIG, "lr": np.float64(0.1)}}, bad)
    elif case == "unbuildable_config":
        torch.save({"model": state, "config": {**CONFIG, "n_head": 3}}, bad)
    return bad


def run_eval(args, capsys):
    """eval.main's exit status and its stderr lines."""
    with pytest.raises(SystemExit) as exit_:
        eval_py.main([str(a) for a in args])
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncated", r"\(\d[\d,]* bytes\) is not a readable torch checkpoint: truncated, corrupted or another format"),
        ("empty", r"is empty \(0 bytes\)"),
        ("random_bytes", r"\(5,000 bytes\) is not a readable torch checkpoint"),
        ("wrong_shape", r"its weights do not fit the model its config describes \(size mismatch for lm_head\.weight"),
        ("no_config", r"lacks the 'model' and 'config' entries train\.py writes \(it holds \['model', 'step'\]\)"),
        ("numpy_in_config", r"holds a numpy\S*scalar object, which torch\.load\(weights_only=True\) refuses"),
        ("unbuildable_config", r"get_model cannot build a model from its config"),
    ],
)
def test_bad_checkpoint_is_one_sentence_and_exit_2(good_checkpoint, capsys, case, message):
    bad = make_bad(good_checkpoint, case)
    code, err = run_eval([bad, "--data", good_checkpoint.with_name("val.bin"), "--device", "cpu"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {bad}")
    assert re.search(message, err[0]), err[0]


def test_good_checkpoint_still_evaluates(good_checkpoint):
    result = eval_py.main(
        [
            str(good_checkpoint),
            "--data",
            str(good_checkpoint.with_name("val.bin")),
            "--device",
            "cpu",
            "--max_tokens",
            "340",
        ]
    )
    assert result["step"] == 3 and result["windows"] == 20 and np.isfinite(result["val_loss"])


def test_bad_checkpoint_from_the_command_line_prints_no_traceback(good_checkpoint):
    bad = make_bad(good_checkpoint, "truncated")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), str(bad), "--data", str(good_checkpoint.with_name("val.bin"))],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: checkpoint {bad}")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "missing.bin"], "--data missing.bin does not exist"),
        (["--data", "odd.bin"], "odd size"),
        (["--data", "big.bin"], "token id 500 >= the model's vocab_size 200"),
        (["--data", "short.bin"], "fewer than one window"),
        (["--data", "short.bin", "--hellaswag", "h.jsonl"], "--hellaswag needs --tokenizer"),
        (["--data", "big.bin", "--seq_len", "0"], "must be positive"),
        *([] if torch.cuda.is_available() else [(["--data", "big.bin", "--device", "cuda"], "no CUDA device")]),
    ],
)
def test_user_errors_are_one_sentence_and_exit_2(good_checkpoint, tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.array([1, 2, 500] * 20, dtype="<u2").tofile(tmp_path / "big.bin")
    np.array([1, 2, 3], dtype="<u2").tofile(tmp_path / "short.bin")
    code, err = run_eval([good_checkpoint, "--device", "cpu", *flags], capsys)  # a later --device wins
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err

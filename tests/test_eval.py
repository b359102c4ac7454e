"""eval.py on bad inputs: every bad checkpoint, flag or HellaSwag row is one sentence on stderr and exit status 2."""

import json
import os
import re
import subprocess
import sys
import warnings
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- odd files and flags


@pytest.fixture(scope="module")
def odd_inputs(good_checkpoint):
    """A folder of inputs eval.py must refuse with one sentence, beside the good checkpoint and val.bin."""
    from conftest import train_tokenizer

    folder = good_checkpoint.parent / "odd"
    folder.mkdir()
    train_tokenizer(folder, ["the red fox jumps over the dog", "a small boat sails on the lake"], vocab_size=40)
    learned = {**CONFIG, "pos": "learned"}
    torch.save({"model": get_model(learned).state_dict(), "config": learned}, folder / "learned.pt")
    (folder / "empty.bin").write_bytes(b"")
    (folder / "a_folder").mkdir()
    (folder / "odd_chunks").mkdir()
    (folder / "odd_chunks" / "chunk_0001.bin").write_bytes(b"\x01\x00\x02")
    (folder / "binary").write_bytes(bytes(range(128, 256)) * 4)  # not UTF-8
    example = {"ctx": "the red fox", "endings": ["jumps over", "sails on"], "label": 0}
    rows = {
        "good": [example, {**example, "label": "1"}],  # some dumps write the label as a string
        "not_objects": [[1, 2]],
        "string_endings": [{**example, "endings": "jumps"}],
        "float_label": [{**example, "label": 0.5}],
        "bool_label": [{**example, "label": True}],
        "label_out_of_range": [{**example, "label": 2}],
        "empty_ending": [{**example, "endings": ["", "sails on"]}],
        "no_label": [{k: v for k, v in example.items() if k != "label"}],
        "one_ending": [{**example, "endings": ["jumps over"]}],
        "long_ending": [{**example, "endings": ["the dog " * 20, "sails on"]}],
    }
    for name, lines in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    (folder / "not_json.jsonl").write_text(json.dumps(example) + "\n{not json\n")
    return folder


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch_size", "0"], "--batch_size must be positive, got 0"),
        (["--max_tokens", "-5"], "--max_tokens must be positive, got -5"),
        (["--seq_len", "-1"], "--seq_len must be positive, got -1"),
        (["CKPT=learned.pt", "--seq_len", "32"], "--seq_len 32 is longer than the checkpoint's learned position table"),
        (["CKPT=a_folder"], "is a folder, not a file"),
        (["--data", "ODD/empty.bin"], "empty.bin is empty (0 bytes)"),
        (["--data", "ODD/a_folder"], "holds neither val.bin nor chunk_*.bin"),
        (["--data", "ODD/odd_chunks"], "chunk_0001.bin has an odd size (3 bytes)"),
        (["--device", "tpu"], "--device tpu is not a device name"),
        (["--device", "meta"], "--device meta is not a device this machine can run the model on"),
        (["--device", "cuda:0x"], "--device cuda:0x is not a device name"),
        (
            ["--tokenizer", "ODD/binary", "--hellaswag", "ODD/good.jsonl"],
            "--tokenizer ODD/binary is not a SentencePiece",
        ),
        (["--tokenizer", "ODD/a_folder", "--hellaswag", "ODD/good.jsonl"], "--tokenizer ODD/a_folder is a folder"),
        (["--hellaswag", "ODD/a_folder"], "--hellaswag ODD/a_folder is a folder"),
        (["--hellaswag", "ODD/missing.jsonl"], "--hellaswag ODD/missing.jsonl does not exist"),
        (["--hellaswag", "ODD/binary"], "--hellaswag ODD/binary is not a text file"),
        (["--hellaswag", "ODD/empty.bin"], "--hellaswag ODD/empty.bin holds no examples"),
        (["--hellaswag", "ODD/not_json.jsonl"], "not_json.jsonl line 2 is not an example"),
        *[
            (["--hellaswag", f"ODD/{case}.jsonl"], f"{case}.jsonl line 1 is not an example")
            for case in (
                "not_objects string_endings float_label bool_label label_out_of_range empty_ending no_label one_ending"
            ).split()
        ],
        (["--hellaswag", "ODD/long_ending.jsonl"], "--hellaswag example 1: every ending needs 1..16 tokens"),
    ],
)
def test_odd_files_and_flags_are_one_sentence_and_exit_2(good_checkpoint, odd_inputs, capsys, flags, message):
    checkpoint = good_checkpoint
    if flags[0].startswith("CKPT="):
        checkpoint, flags = odd_inputs / flags[0][len("CKPT=") :], flags[1:]
    if "--hellaswag" in flags and "--tokenizer" not in flags:
        flags = [*flags, "--tokenizer", "ODD/tok.model"]
    flags = [flag.replace("ODD", str(odd_inputs)) for flag in flags]
    code, err = run_eval(
        [checkpoint, "--data", good_checkpoint.with_name("val.bin"), "--device", "cpu", *flags], capsys
    )
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert message.replace("ODD", str(odd_inputs)) in err[0], err


def test_a_cuda_index_past_the_visible_devices_is_one_sentence(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"--device cuda:2 was given but only cuda:0 to cuda:1 are visible"):
        eval_py.user_device("cuda:2")


def test_hellaswag_labels_written_as_strings_still_count(good_checkpoint, odd_inputs):
    result = eval_py.main(
        [
            str(good_checkpoint),
            "--data",
            str(good_checkpoint.with_name("val.bin")),
            "--device",
            "cpu",
            "--hellaswag",
            str(odd_inputs / "good.jsonl"),
            "--tokenizer",
            str(odd_inputs / "tok.model"),
        ]
    )
    assert result["hellaswag_examples"] == 2 and 0 <= result["hellaswag_acc"] <= 1


def test_a_damaged_checkpoint_warns_nothing_beside_its_sentence(tmp_path):
    bad = tmp_path / "protocol_129.pt"
    bad.write_bytes(bytes(range(128, 256)))  # reads as pickle protocol 129, which torch warns about before failing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"\(128 bytes\) is not a readable torch checkpoint"):
            eval_py.load_checkpoint(bad)
    assert not caught, [str(w.message) for w in caught]


# ----------------------------------------------------------------------------- HellaSwag rows


HELLASWAG_ROWS = {
    "ctx_b null": {"ctx_a": "A man", "ctx_b": None, "endings": ["runs.", "sits."], "label": 0},
    "ctx_b missing": {"ctx_a": "A man", "endings": ["runs.", "sits."], "label": 0},
    "ctx null": {"ctx": None, "endings": ["runs.", "sits."], "label": 0},
    "an ending null": {"ctx": "A man", "endings": ["runs.", None], "label": 0},
    "label null": {"ctx": "A man", "endings": ["runs.", "sits."], "label": None},
    "endings missing": {"ctx": "A man", "label": 0},
}


@pytest.mark.parametrize("row", HELLASWAG_ROWS.values(), ids=HELLASWAG_ROWS.keys())
def test_a_hellaswag_row_missing_a_field_is_one_sentence_naming_the_row(tmp_path, row):
    import eval as E

    good = {"ctx": "A woman", "endings": ["walks.", "talks."], "label": 1}
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"line 2 is not an example") as e:
        E.load_hellaswag(str(path))
    assert "None" not in str(e.value).replace(str(path), "")

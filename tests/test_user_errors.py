"""What train.py does with the flags and inputs a user gives it. A flag's value is read in the nanoGPT idiom; a bad
one (a flag or a model switch out of its range, an output that cannot be written, missing data, a plan this machine
cannot run) is refused before the clock in one sentence naming it, exit 2, with nothing written and a previous run's
checkpoint kept. The checks run in process in the fast tier; whole runs (small subprocesses on 2 CPU cores) in the
slow tier."""

import dataclasses

import pytest
import torch

import config
from conftest import SHAPE, TINY, VOCAB, run_train, synthetic_time_run
from model import GPTConfig


# ----------------------------------------------------------------------------- how a flag's value is read


@pytest.mark.parametrize(
    "argv, name, value",
    [
        (["--compile", "False"], "compile", False),
        (["--compile=false"], "compile", False),
        (["--compile", "0"], "compile", False),
        (["--compile", "yes"], "compile", True),
        (["--compile"], "compile", True),
        (["--no-compile"], "compile", False),
        ([], "compile", "auto"),
        (["--doc_aligned", "True", "--seq_len", "64"], "doc_aligned", True),
        (["--doc_aligned", "--seq_len", "64"], "doc_aligned", True),  # a bare flag takes no value that is a flag
        (["--dry_run", "no"], "dry_run", False),
    ],
)
def test_a_boolean_flag_reads_its_value_in_the_nanogpt_idiom(argv, name, value):
    hp, _, unknown = config.parse_args(argv)
    assert getattr(hp, name) == value and unknown == [], (argv, getattr(hp, name), unknown)


def test_a_model_switch_reads_its_value_too():
    assert config.parse_args(["--qk_norm", "False", "--backout=0", "--smear", "true"])[1] == {
        "qk_norm": False,
        "backout": False,
        "smear": True,
    }
    assert config.parse_args(["--no-ve_gate", "--attn_gate"])[1] == {"ve_gate": False, "attn_gate": True}


UNREADABLE = [["--compile", "Flase"], ["--doc_aligned=maybe"], ["--qk_norm", "2"], ["--seq_len", "x"]]


@pytest.mark.parametrize("argv", UNREADABLE)
def test_a_value_a_flag_cannot_take_is_one_sentence_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as leaving:
        config.parse_args(argv)
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 2 and error.startswith("error: argument " + argv[0].split("=")[0]), error
    assert "\n" not in error and "usage" not in error, error


def test_a_flag_other_flags_override_is_checked_and_said(capsys):
    import train

    hp, _, _ = config.parse_args(["--model", "l4w12", "--n_layer", "2"])  # a typo the shape flags would hide
    with pytest.raises(ValueError, match="--model must be 'auto' or one of"):
        config.check_flags(hp)
    for argv, words in [
        (["--model", "l4w128", "--n_layer", "2"], "--model l4w128 is not used: the shape flags (n_layer)"),
        (["--optimizer", "adamw", "--muon_lr", "0.1"], "--muon_lr 0.1 is not used: --optimizer adamw"),
        (["--adamw_lr", "0.01"], "--adamw_lr 0.01 is not used"),
        (["--world_size", "32"], "--world_size 32 is not used"),
    ]:
        hp, _, _ = config.parse_args(argv)
        config.check_flags(hp)
        assert [words in s for s in config.overridden_flags(hp)] == [True], argv
    assert config.overridden_flags(config.parse_args(["--world_size", "32", "--dry_run"])[0]) == []
    train.main(["--dry_run", "--world_size", "2", "--model", "l2w64", "--n_layer", "2", "--device", "cpu"])
    assert "warning: --model l2w64 is not used" in capsys.readouterr().out


# ----------------------------------------------------------- a bad flag or input: one sentence, exit 2, nothing written


def flagged(*args):
    return lambda tmp_path, token_dir: (["--data_dir", str(token_dir), *args], args[0])


def directory_checkpoint(tmp_path, token_dir):
    (tmp_path / "a_folder").mkdir()
    return ["--data_dir", str(token_dir), "--checkpoint_path", str(tmp_path / "a_folder")], "--checkpoint_path"


def blocked_checkpoint(tmp_path, token_dir):
    (tmp_path / "blocker").write_text("a file, so nothing can be created under it (chmod means nothing to root)")
    return [
        "--data_dir",
        str(token_dir),
        "--checkpoint_path",
        str(tmp_path / "blocker" / "ckpt.pt"),
    ], "--checkpoint_path"


def missing_data_dir(tmp_path, token_dir):
    return ["--data_dir", str(tmp_path / "no_such_dir")], "--data_dir"


FLAG_CASES = {  # caught by check_flags alone: run in-process below, and end to end in the slow tier
    "batch_size 0": flagged("--batch_size", "0"),
    "batch_size negative": flagged("--batch_size", "-3"),
    "n_head 0": flagged("--n_head", "0"),
    "seq_len 0": flagged("--seq_len", "0"),
    "time limit inf": flagged("--time_limit_min", "inf"),
    "time limit nan": flagged("--time_limit_min", "nan"),
    "grad_accum_steps 0": flagged("--grad_accum_steps", "0"),
    "zero decay": flagged("--decay_frac", "0"),
    "warmup the whole run (cosine)": flagged("--warmup_frac", "1.0", "--schedule", "cosine"),
    "warmup past the end": flagged("--warmup_frac", "1.5"),
}
if not torch.cuda.is_available():
    FLAG_CASES["cuda without a GPU"] = flagged("--device", "cuda")


CASES = {
    "checkpoint is a folder": directory_checkpoint,
    "checkpoint not writable": blocked_checkpoint,
    "missing data": missing_data_dir,
    "seq_len above the validation set": flagged("--val_tokens", "2000", "--seq_len", "4096"),
    **FLAG_CASES,
}


@pytest.mark.parametrize("case", FLAG_CASES.values(), ids=FLAG_CASES.keys())
def test_flag_errors_are_one_sentence_naming_the_flag(tmp_path, token_dir, case):
    import config

    args, flag = case(tmp_path, token_dir)
    hp, _, _ = config.parse_args(args)
    with pytest.raises(ValueError) as error:
        config.check_flags(hp)
    assert flag in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_bad_flag_or_input_exits_2_in_one_sentence_before_anything_is_written(tmp_path, token_dir, case):
    args, flag = case(tmp_path, token_dir)
    trained = tmp_path / "checkpoint.pt"  # a previous run's checkpoint: a rejected run must leave it alone
    trained.write_bytes(b"trained weights")
    base = ["--vocab_size", str(VOCAB), *SHAPE, "--val_tokens", "4096", "--val_eval_tokens", "2048"]
    proc, _ = run_train([*base, *args], tmp_path, timeout=120, expect_rc=2)
    error = proc.stderr.strip().splitlines()
    assert error[-1].startswith("error: ") and flag in error[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "plan:" not in proc.stdout  # no model, no forward pass
    assert trained.read_bytes() == b"trained weights"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "a_folder" and p.name != "blocker") == [
        "checkpoint.pt"
    ]


RANGE_CASES = [
    ["--seed", "-1"],
    ["--seed", str(2**32)],
    ["--muon_lr", "nan"],
    ["--embed_lr", "-0.1"],
    ["--head_lr", "inf"],
    ["--muon_weight_decay", "inf"],
    ["--adam_weight_decay", "-1"],
    ["--muon_momentum", "1.0"],
    ["--muon_momentum_start", "-0.5"],
    ["--momentum_warmup_frac", "2"],
    ["--min_lr_frac", "1.5"],
    ["--auto_efficiency", "3"],
    ["--vocab_size", str(2**32 + 1)],  # above uint32's ids
    ["--vocab_size", "1"],
    ["--bos_id", "-1"],
    ["--token_dtype", "uint8"],
    ["--val_tokens", str(10**9)],
    ["--collective_timeout_min", "0"],
    ["--log_every_s", "-1"],
    ["--peak_tflops", "nan"],
    ["--micro_batch", "0"],
    ["--optimizer", "sgd"],
    ["--warmup_frac", "0.7"],
]


@pytest.mark.parametrize("argv", RANGE_CASES, ids=" ".join)
def test_every_numeric_flag_has_a_range_checked_before_anything_runs(argv):
    import config

    hp, _, _ = config.parse_args(argv)
    with pytest.raises(ValueError, match=argv[0]):
        config.check_flags(hp)


SWITCH_CASES = {
    "gate LR negative": ("--gate_lr_mult", "-0.1"),
    "gate LR nan": ("--gate_lr_mult", "nan"),
    "gate LR inf": ("--gate_lr_mult", "inf"),
    "rope base inf": ("--rope_base", "inf"),
    "rope base 1": ("--rope_base", "1"),
    "untie at the end": ("--untie_at", "1"),
    "untie negative": ("--untie_at", "-0.5"),
    "bigram nan": ("--bigram_mult", "nan"),
    "softcap negative": ("--logit_softcap", "-1"),
    "mlp ratio 0": ("--mlp_ratio", "0"),
}


@pytest.mark.parametrize("flag, value", SWITCH_CASES.values(), ids=SWITCH_CASES.keys())
def test_a_model_switch_out_of_its_range_is_one_sentence_naming_it(flag, value):
    hp, switches, _ = config.parse_args([flag, value])
    with pytest.raises(ValueError) as error:
        config.check_flags(hp, switches)
    assert str(error.value).startswith(f"{flag} must be") and "\n" not in str(error.value), error.value
    config.check_flags(hp, {})  # the dataclass flags alone are fine


def test_the_default_switches_and_an_ablation_are_in_range():
    hp, switches, _ = config.parse_args(["--gate_lr_mult", "0", "--bigram_mult", "0", "--untie_at", "0.5"])
    config.check_flags(hp, switches)
    config.check_flags(hp, {f.name: f.default for f in dataclasses.fields(GPTConfig)})


def test_a_gate_lr_that_would_train_silently_wrong_exits_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as leaving:
        train.main([*TINY, "--gate_lr_mult", "nan", "--checkpoint_path", str(tmp_path / "ckpt.pt")])
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 2 and error == "error: --gate_lr_mult must be a finite number, got nan", error
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- a plan this machine cannot run


@pytest.mark.slow
def test_a_plan_that_does_not_fit_in_memory_is_refused_before_the_step0_save(tmp_path):
    trained = tmp_path / "checkpoint.pt"
    trained.write_bytes(b"trained weights")
    args = [*SHAPE, "--seq_len", "1024", "--micro_batch", "4096", "--val_tokens", "4096", "--device_memory_gib", "1"]
    proc, _ = run_train(args, tmp_path, expect_rc=2)
    assert "the plan needs" in proc.stderr and "GiB per device" in proc.stderr and "Traceback" not in proc.stderr
    assert trained.read_bytes() == b"trained weights"


@pytest.mark.slow
def test_a_step_that_outlasts_the_whole_budget_is_refused_before_the_clock(tmp_path):
    args = synthetic_time_run(tmp_path, ["--batch_tokens", str(1 << 22), "--val_tokens", "4096"], budget_min=0.1)
    proc, _ = run_train(args, tmp_path, expect_rc=2)
    assert "longer than the whole" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoint.pt").exists()

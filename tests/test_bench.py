"""The benchmark scripts are not run here (they take minutes); these check that they start and parse flags, and
the step clock that bench/head_loss.py's phase table rests on."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=120)


SCRIPTS = [
    "bench/speedrun.py",
    "bench/throughput.py",
    "bench/bench_muon.py",
    "bench/step_work.py",
    "bench/head_loss.py",
    "bench/compile_time.py",
    "bench/comm_bytes.py",
    "bench/validation_cost.py",
    "bench/lr_sweep.py",
    "bench/ns_error.py",
    "bench/attention_backends.py",
    "bench/host_share.py",
    "bench/zero_grad.py",
    "bench/profile_summary.py",
    "bench/corpus_text.py",
    "bench/simulated_clock.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    result = run(script, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout


def test_speedrun_rejects_unknown_variant_and_missing_corpus(tmp_path):
    bad = run("bench/speedrun.py", "--variants", "default,nonsense", "--corpus", str(tmp_path))
    assert bad.returncode == 2 and "nonsense" in bad.stderr
    missing = run("bench/speedrun.py", "--variants", "default", "--corpus", str(tmp_path / "none"))
    assert missing.returncode == 2 and "setup.sh" in missing.stderr


def test_every_speedrun_variant_parses_in_train():
    """Each variant's flags must be real train.py flags: an unknown one would be ignored and the ablation void."""
    sys.path.insert(0, str(REPO / "bench"))
    import speedrun
    from config import parse_args

    for name, flags in {**speedrun.VARIANTS, **speedrun.CALIBRATION}.items():
        _, _, unknown = parse_args([*speedrun.SHAPE, *flags.split()])
        assert not unknown, (name, unknown)


def test_gpu_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(REPO / "bench/gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_lr_sweep_and_gpu_ab_variant_parses_in_train():
    """bench/lr_sweep.py's runs and bench/gpu_ab.sh's default variants use real train.py flags with valid values."""
    import argparse
    import re

    sys.path.insert(0, str(REPO / "bench"))
    import lr_sweep
    from config import check_flags, parse_args

    args = argparse.Namespace(seeds=3, first_seed=0, chosen="--muon_lr 0.025")
    runs = [flags for sweep in lr_sweep.sweeps(args).values() for flags, _ in sweep.values()]
    gpu_ab = (REPO / "bench/gpu_ab.sh").read_text()
    variants = re.search(r'VARIANTS=\$\{VARIANTS:-"(.*)"\}', gpu_ab).group(1)
    runs += [spec.partition("=")[2] for spec in variants.split(";")]
    assert len(runs) > 20
    for flags in runs:
        hp, _, unknown = parse_args(flags.split())
        assert not unknown, (flags, unknown)
        check_flags(hp)
    assert subprocess.run(["bash", "-n", str(REPO / "bench/gpu_ab.sh")]).returncode == 0


def test_head_loss_phase_clock_splits_the_step_without_changing_it():
    """bench/head_loss.py's phases: each non-negative (the norm hook fired inside the forward), the loss math timed on
    the chunked path only, the timed chunk_loss giving the untimed loss."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import head_loss
    from model import get_model
    from headloss import head_loss as loss_fn

    config = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 512, "seq_len": 16}
    torch.manual_seed(0)
    model = get_model(config)
    x, y = torch.randint(0, 512, (2, 2, 16))
    expected = model(x, y, loss_fn=loss_fn)[1].item()
    clock = head_loss.PhaseClock(model)
    assert model(x, y, loss_fn=clock.loss_fn)[1].item() == expected
    for chunked in (True, False):
        phases = clock.step(x, y, chunked, ())
        assert all(ms >= 0 for ms in phases.values()), phases
        assert (phases["loss math"] > 0) == chunked, phases

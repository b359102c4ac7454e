"""The benchmark scripts are not run here (they take minutes); these check that they start and parse flags."""

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
    "bench/head_loss.py",
    "bench/compile_time.py",
    "bench/comm_bytes.py",
]


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
    from train import parse_args

    for name, flags in {**speedrun.VARIANTS, **speedrun.CALIBRATION}.items():
        _, _, unknown = parse_args([*speedrun.SHAPE, *flags.split()])
        assert not unknown, (name, unknown)


def test_gpu_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(REPO / "bench/gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

"""The event run survives what nobody has measured (issue 32): torchrun as pid 1, one rank's exit, several ranks on
one GPU, legal but unusable values, and an older torch. Subprocess runs are small, on 2 CPU cores."""

import shutil
import signal
import subprocess
import sys

import pytest

from conftest import TINY, TRAIN, child_env, read_metrics

# ----------------------------------------------------------------------------- torchrun as pid 1


class FakeLibc:
    def prctl(self, option, value):
        return 0


@pytest.mark.parametrize("before, after, killed", [(1, 1, False), (4321, 4321, False), (4321, 1, True)])
def test_a_parent_of_pid_1_is_a_launcher_not_a_dead_one(monkeypatch, before, after, killed):
    import train

    sent = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(train.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(train.os, "getppid", lambda: after)
    monkeypatch.setattr(train.os, "kill", lambda pid, sig: sent.append(sig))
    train.stop_with_the_launcher(before)
    assert sent == ([signal.SIGTERM] if killed else [])


def unshare_works():
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
def test_torchrun_as_pid_1_trains_to_the_time_limit(tmp_path):
    if not unshare_works():
        pytest.skip("unshare --pid needs root (or user namespaces) here")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    argv = [*torchrun, str(TRAIN), "--device", "cpu", *TINY, "--time_limit_min", "0.25"]
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", *argv],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "time_limit" and summary["steps"] > 10, summary

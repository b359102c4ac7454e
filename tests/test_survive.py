"""The event run survives what nobody has measured (issue 32): torchrun as pid 1, one rank's exit, several ranks on
one GPU, legal but unusable values, and an older torch. Subprocess runs are small, on 2 CPU cores."""

import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import config
from conftest import ROOT, TINY, TRAIN, child_env, read_metrics

# ----------------------------------------------------------------------------- torchrun as pid 1


class FakeLibc:
    def prctl(self, option, value):
        return 0


@pytest.mark.parametrize("before, after, killed", [(1, 1, False), (4321, 4321, False), (4321, 1, True)])
def test_a_parent_of_pid_1_is_a_launcher_not_a_dead_one(monkeypatch, before, after, killed):
    import ranks

    sent = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(ranks.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(ranks.os, "getppid", lambda: after)
    monkeypatch.setattr(ranks.os, "kill", lambda pid, sig: sent.append(sig))
    ranks.stop_with_the_launcher(before)
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


# ----------------------------------------------------------------------------- one rank leaves, all leave

# Workers run through this wrapper: it breaks one thing on one rank (FAULT), then runs train.main() as torchrun would.
FAULTY_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
import checkpoint, launch, prefetch, train, windows
rank, fault = int(os.environ["RANK"]), os.environ["FAULT"]
if fault == "unreadable" and rank == 1:
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/data/chunk_0001.bin")
    launch.load_token_data = refuse
if fault == "data_gone" and rank == 1:
    served, real_next = [0], prefetch.Prefetcher.__next__
    def next_or_gone(self):
        served[0] += 1
        if served[0] > 40:
            raise windows.DataChanged("every training file changed under the run; rank 1 has nothing left to read.")
        return real_next(self)
    prefetch.Prefetcher.__next__ = next_or_gone
if fault == "final_save" and rank == 0:
    real_save = checkpoint.save_checkpoint
    def full_disk(state, path):
        if state["step"] > 0:
            raise checkpoint.CheckpointError(f"could not save {{path}} (No space left on device)")
        real_save(state, path)
    checkpoint.save_checkpoint = full_disk
train.main()
"""


def faulty_run(tmp_path, fault, extra=()):
    """A 2-rank gloo torchrun whose workers run FAULTY_WORKER: (process, wall seconds)."""
    worker = tmp_path / "worker.py"
    worker.write_text(FAULTY_WORKER.format(root=str(ROOT)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    argv = [*torchrun, "--device", "cpu", *TINY, "--save_every_min", "0", *extra]
    start = time.perf_counter()
    proc = subprocess.run(
        argv, cwd=tmp_path, env={**child_env(), "FAULT": fault}, capture_output=True, text=True, timeout=300
    )
    return proc, time.perf_counter() - start


@pytest.mark.slow
def test_one_ranks_unreadable_file_ends_every_rank_with_one_sentence(tmp_path):
    proc, wall = faulty_run(tmp_path, "unreadable", ["--time_limit_min", "10"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1: /data/chunk_0001.bin: Permission denied"], proc.stderr[-3000:]
    assert proc.returncode != 0 and wall < 60 and "]: Traceback" not in proc.stderr  # no worker's traceback
    assert not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.slow
def test_one_rank_whose_data_is_gone_stops_every_rank_together_with_the_weights_saved(tmp_path):
    proc, wall = faulty_run(tmp_path, "data_gone", ["--time_limit_min", "10"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopping: rank 1 has no training data left to read" in proc.stdout
    assert wall < 90  # not the 10-minute budget, nor the 5-minute collective timeout
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "data" and summary["steps"] > 0 and summary["world_size"] == 2
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == summary["steps"]


@pytest.mark.slow
def test_a_failed_final_save_on_rank_0_still_ends_every_rank_at_once(tmp_path):
    proc, wall = faulty_run(tmp_path, "final_save", ["--time_limit_min", "0.2"])
    assert proc.returncode != 0 and "error: the final save failed" in proc.stdout, proc.stderr[-3000:]
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")  # rank 0 still validated with rank 1
    assert summary["stop_reason"] == "time_limit" and summary["val_loss"] > 0
    assert wall < 12 + 60, wall  # the 12 s budget and start-up; not the 5-minute collective timeout
    assert "exitcode  : 1" in proc.stderr and "<NO_OTHER_FAILURES>" in proc.stderr  # rank 1 ended on its own, 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 0  # the step-0 save stays


# ----------------------------------------------------------------------------- several ranks on one GPU


def test_ranks_that_would_share_a_gpu_are_refused_and_one_gpu_per_task_is_kept():
    from ranks import cuda_index

    assert cuda_index(3, visible=8, local_world=8, torchrun=True) == 3
    assert cuda_index(5, visible=1, local_world=8) == 0  # srun --gpus-per-task=1: each task its own GPU
    assert cuda_index(0, visible=1, local_world=1, torchrun=True) == 0
    for local_world, visible, torchrun in [(8, 1, True), (8, 4, True), (8, 4, False)]:
        with pytest.raises(ValueError, match=f"{local_world} ranks on this node .* {visible} GPU"):
            cuda_index(0, visible=visible, local_world=local_world, torchrun=torchrun)


def test_eight_torchrun_ranks_on_one_visible_gpu_exit_2_before_anything(monkeypatch, capsys):
    import ranks

    monkeypatch.setattr(ranks.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ranks.torch.cuda, "set_device", lambda d: pytest.fail("a device was claimed"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with pytest.raises(SystemExit) as leaving:
        ranks.init_device(types.SimpleNamespace(device="cuda"), rank=5, local_rank=5, world=8)
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 2 and error.count("\n") == 0 and "share a GPU" in error, error


# ----------------------------------------------------------------------------- legal but unusable


@pytest.mark.slow
def test_a_launch_environment_whose_peer_never_comes_is_one_sentence(tmp_path):
    import socket

    with socket.socket() as s:  # a free port: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**child_env(), "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--device", "cpu", *TINY, "--collective_timeout_min", "0.05"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    error = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(error) == 1 and "did not all join" in error[0], proc.stderr[-2000:]
    assert time.perf_counter() - start < 60 and not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the torch the organizers have


def test_an_older_torch_or_one_without_the_run_path_apis_is_one_sentence(monkeypatch):
    import launch
    import ranks

    assert ranks.torch_problem(torch.__version__) is None and ranks.torch_problem("2.6.0+cu124") is None
    assert "older than 2.6" in ranks.torch_problem("2.5.1+cu121")
    no_stance = types.SimpleNamespace()
    assert "lacks set_stance" in ranks.torch_problem("2.7.0", compiler=no_stance)
    assert "lacks all_gather_into_tensor" in ranks.torch_problem("2.7.0", distributed=types.SimpleNamespace())
    monkeypatch.setattr(launch.torch, "__version__", "2.4.0")  # launch() says it before anything else
    with pytest.raises(SystemExit) as leaving:
        launch.launch(None, {}, [], print)
    assert leaving.value.code == 2


def test_apis_newer_than_the_floor_have_their_fallbacks():
    import muon
    import ranks

    older = types.SimpleNamespace(all_gather_into_tensor=lambda *a: "2.6's name")
    assert muon.flat_gather(older)() == "2.6's name"
    assert ranks.lower_backward_in_forward(types.SimpleNamespace()) is False  # 2.6: not there, nothing raised
    config = types.SimpleNamespace(force_non_lazy_backward_lowering=False)
    assert ranks.lower_backward_in_forward(config) is True and config.force_non_lazy_backward_lowering


def test_the_floor_is_stated_in_requirements_pyproject_and_readme(tmp_path):
    import bundle
    import ranks

    floor = "torch>=" + ".".join(map(str, ranks.TORCH_FLOOR))
    assert floor in bundle.bundle_files(ROOT)["requirements.txt"].splitlines()
    assert f'"{floor}"' in (ROOT / "pyproject.toml").read_text() and floor in (ROOT / "README.md").read_text()


def test_a_checkpoint_name_at_the_file_system_limit_saves_and_one_past_it_is_one_sentence(tmp_path):
    import checkpoint

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("c" * (limit - 3) + ".pt")  # legal; its temporary sibling is cut to fit
    checkpoint.check_writable(str(longest), "checkpoint_path")
    checkpoint.Checkpointer(str(longest)).save(torch.nn.Linear(2, 2), {"step": 1}, background=False)
    assert [p.name for p in tmp_path.iterdir()] == [longest.name]
    with pytest.raises(ValueError, match=f"--checkpoint_path names a file of {limit + 1} bytes, longer than the"):
        checkpoint.check_writable(str(tmp_path / ("c" * (limit + 1))), "checkpoint_path")


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

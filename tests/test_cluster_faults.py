"""What the cluster does to a run: a rank frozen, killed or gone before, during or after training; signals, and a
launcher that is killed or runs as pid 1; the SLURM wall and the batch step; a launch environment that cannot work
(rank variables, a busy port, a peer that never comes, ranks that would share a GPU); the torch installed. A run ends
with every rank at once, in one sentence or with the weights saved, never a hang or a traceback. Whole runs are small
subprocesses on 2 CPU cores (one or two gloo ranks), in the slow tier."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import (
    FLOOR,
    ROOT,
    SHAPE,
    TINY,
    TRAIN,
    child_env,
    command,
    first_row,
    free_port,
    on_tokens,
    patched_train,
    read_metrics,
    step_seconds,
    synthetic_time_run,
)
from eval import load_checkpoint


# ----------------------------------------------------------------------------- a rank frozen, lost or killed


@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_after_the_collective_timeout(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, "--time_limit_min", "10", "--collective_timeout_min", "0.1"]
    proc = subprocess.Popen(
        command(args, 2),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        os.kill(int(ranks[-1]), signal.SIGSTOP)
        start = time.perf_counter()
        _, err = proc.communicate(timeout=120)
        waited = time.perf_counter() - start
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0 and "lost contact with the other ranks" in err, err[-3000:]
    assert waited < 60  # 6 s of timeout, then torchrun tears the job down; not the SLURM wall
    model, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert all(math.isfinite(v.float().sum()) for v in ckpt["model"].values())


@pytest.mark.parametrize(
    "message, lost",
    [
        ("Got the following error when running the callback: RuntimeError: Application timeout caused pair closure", 1),
        ("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset by peer", 1),
        ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)", 1),
        ("Wait timed out after 6000ms", 1),
        ("CUDA error: an illegal memory access was encountered", 0),
        ("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)", 0),
    ],
)
def test_a_peer_lost_is_told_from_other_runtime_errors(message, lost):
    """train.main ends a multi-rank run with 'lost contact' (exit 1, the last save kept) on these, and re-raises the
    rest. The first: the frozen-rank test's error when the timeout hits inside DDP's gradient hook."""
    from ranks import lost_contact

    assert lost_contact(RuntimeError(message)) == bool(lost)
    assert lost_contact(torch.distributed.DistError("anything"))


# Rank 1 runs through this wrapper and is killed (SIGKILL: no handler, no goodbye) at PHASE; rank 0 runs train.py.
DYING_WORKER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import launch, train

def dying(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

phase = os.environ["PHASE"]
if phase == "finish":  # after every rank saved and validated, right before the final barrier
    finish = train.Trainer.finish
    train.Trainer.finish = lambda trainer: finish(trainer) and dying()
else:  # in place of that collective: rank 0 waits in it for a peer that is gone
    setattr(launch, phase, dying)
train.main()
"""


def two_ranks_rank_1_dying(tmp_path, phase, args):
    """Rank 0 (train.py) and rank 1 (DYING_WORKER), started by hand so that each exit code is seen: rank 0's
    (returncode, stdout, stderr)."""
    worker = tmp_path / "worker.py"
    worker.write_text(DYING_WORKER.format(root=str(ROOT)))
    port = free_port()
    env = {**child_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PHASE": phase}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=tmp_path,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, script in ((0, TRAIN), (1, worker))
    ]
    out, err = ranks[0].communicate(timeout=240)
    ranks[1].communicate(timeout=60)
    assert ranks[1].returncode == -9, ranks[1].returncode
    return ranks[0].returncode, out, err


def test_a_lost_peer_before_the_clock_is_one_sentence_and_exit_1(monkeypatch, capsys):
    import ranks
    import train

    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50877. This is typically caused by ...")
    monkeypatch.setattr(ranks.dist, "is_initialized", lambda: True)  # train.dist and ranks.dist: one module
    monkeypatch.setattr(ranks.dist, "get_rank", lambda: 3)
    with pytest.raises(RuntimeError):  # a check's collective: not swallowed into an input error's sentence
        ranks.sentence(gone)
    assert ranks.sentence(ValueError("--seq_len must be at least 1, got 0")) == "--seq_len must be at least 1, got 0"

    def launch(*args):
        raise gone

    monkeypatch.setattr(train, "launch", launch)
    with pytest.raises(SystemExit) as leaving:
        train.main(["--device", "cpu"])
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 1 and error.count("\n") == 0, error
    assert error.startswith("error: rank 3 lost contact with the other ranks before training ([pair.cc:553] Conn")
    monkeypatch.setattr(train, "launch", lambda *args: ranks.fail("error: an input error", code=2))
    with pytest.raises(SystemExit) as leaving:
        train.main(["--device", "cpu"])
    assert leaving.value.code == 2


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["training_deadline", "agreed_matmul_rate"])  # outside, inside a check's try
def test_a_rank_that_dies_before_the_clock_leaves_one_sentence(tmp_path, token_dir, phase):
    rc, out, err = two_ranks_rank_1_dying(tmp_path, phase, [*on_tokens(token_dir), *TINY, "--device", "cpu"])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("error: rank 0 lost contact with the other ranks before training ("), errors


@pytest.mark.slow
def test_a_rank_that_dies_after_the_run_finished_leaves_it_finished(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, "--device", "cpu", "--time_limit_min", "0.1"]
    rc, out, err = two_ranks_rank_1_dying(tmp_path, "finish", args)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "warning: rank 0: a peer left before the final barrier (" in err
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "time_limit" and summary["world_size"] == 2 and val[-1]["val_loss"] > 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == summary["steps"] > 0


# Each rank runs this before train.main: it breaks one thing on one rank (FAULT).
FAULTS = """
import prefetch, windows
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
            raise checkpoint.CheckpointError(f"could not save {path} (No space left on device)")
        real_save(state, path)
    checkpoint.save_checkpoint = full_disk
"""


def faulty_run(tmp_path, fault, extra=()):
    """A 2-rank gloo torchrun whose ranks run FAULTS first: (process, wall seconds)."""
    args = ["--device", "cpu", *TINY, "--save_every_min", "0", *extra]
    proc, started = patched_train(tmp_path, FAULTS, args, env={"FAULT": fault}, nproc=2)
    return proc, time.time() - started


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


# ----------------------------------------------------------------------------- signals and the launcher


@pytest.mark.slow
def test_a_launcher_killed_by_a_signal_it_does_not_forward_leaves_no_orphan_and_its_workers_save(tmp_path, token_dir):
    # SIGUSR1 (sbatch --signal) kills torchrun outright; its workers are then told to stop (PR_SET_PDEATHSIG)
    args = [*on_tokens(token_dir), *TINY, "--time_limit_min", "10"]
    proc = subprocess.Popen(
        command(args, 2), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2
        proc.send_signal(signal.SIGUSR1)
        proc.communicate(timeout=60)
        deadline = time.perf_counter() + 60
        while any(os.path.exists(f"/proc/{w}") for w in workers) and time.perf_counter() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{w}") for w in workers), "a worker outlived its launcher"
    finally:
        proc.kill()
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "signal" and summary["world_size"] == 2
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"] > 0


@pytest.mark.slow
def test_a_stop_inside_a_long_accumulation_is_honoured_between_micro_steps(tmp_path, token_dir):
    # 1,920 micro-batches a step: a step takes ~12 s on an idle 2-core box (more under load), a micro-step ~6 ms
    args = [*on_tokens(token_dir), *SHAPE, "--seq_len", "32", "--micro_batch", "8", "--batch_tokens", str(1920 * 256)]
    proc = subprocess.Popen(
        command([*args, "--time_limit_min", "10", "--val_tokens", "4096"], 1),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        proc.communicate(timeout=120)
        honoured = time.perf_counter() - signalled
    finally:
        proc.kill()
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    step_s = step_seconds(rows) if len(rows) > 2 else rows[-1]["elapsed_s"] / rows[-1]["step"]
    assert summary["stop_reason"] == "signal" and summary["grad_accum_steps"] == 1920
    assert honoured < min(0.25 * step_s, 5.0), (honoured, step_s)  # not the rest of the step: a micro-step, save, exit
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"]  # the interrupted step's gradients were dropped, not half-applied


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


# ----------------------------------------------------------------------------- the SLURM wall and the batch step


@pytest.mark.slow
def test_the_budget_ends_before_the_slurm_wall_measured_from_the_deadline(tmp_path):
    """A pre-clock phase slowed by 8 s (as a slow step-0 save or a long model build would): training still ends
    --slurm_reserve_s before the job's end, because the budget is taken from the deadline when the clock starts."""
    end = int(time.time()) + 60
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(end)}
    args = synthetic_time_run(tmp_path, ["--val_tokens", "8192", "--slurm_reserve_s", "25"], budget_min=10)
    slowed = "build = launch.build_model; launch.build_model = lambda *a: (time.sleep(8), build(*a))[1]"
    proc, _ = patched_train(tmp_path, slowed, args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the SLURM job ends in" in proc.stdout
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    step_s = step_seconds(rows)
    assert summary["clock_start_unix"] + summary["train_s"] <= end - 25 + step_s + 1.0, (summary, step_s)
    assert summary["budget_s"] < 35 - 8 + 1 and summary["final_lr_frac"] == FLOOR
    assert summary["stop_reason"] == "time_limit"


@pytest.mark.parametrize("value", ["soon", "", "nan", "inf", "2025-01-01T10:00:00"])
def test_a_slurm_end_time_that_is_not_a_time_is_one_warning_and_no_deadline(monkeypatch, value):
    import deadline

    monkeypatch.setenv("SLURM_JOB_END_TIME", value)
    said = []
    assert deadline.slurm_end_time(said.append) is None
    assert len(said) == 1 and "is not a time; no SLURM deadline" in said[0]
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 300))
    assert deadline.slurm_end_time(said.append) > time.time() and len(said) == 1


def fake_slurm(tmp_path, env_extra):
    """Run submit_slurm.sh as the batch step on this host, with scontrol and srun stubs: (process, srun's argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nhostname -s\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun_args\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {
        **child_env(),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "CPU": "1",
        "DATA_DIR": "",
        **env_extra,
    }
    script = ROOT / "submit_slurm.sh"
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    args = (tmp_path / "srun_args").read_text().split("\n") if (tmp_path / "srun_args").exists() else []
    return proc, args


def test_a_busy_rendezvous_port_is_moved_off_or_refused_and_the_rendezvous_is_bounded(tmp_path):
    import socket

    holder = socket.socket()
    try:
        holder.bind(("", 29500))
    except OSError:
        pass  # someone else holds it: busy either way
    holder.listen()
    try:
        proc, args = fake_slurm(tmp_path, {})
        assert proc.returncode == 0, proc.stderr
        assert "port 29500 is in use" in proc.stdout
        endpoint = next(a for a in args if a.startswith("--rdzv_endpoint="))
        assert not endpoint.endswith(":29500") and "--rdzv_conf=join_timeout=120" in args
        given = tmp_path / "given"  # a port the user chose: refused, not moved
        given.mkdir()
        proc, args = fake_slurm(given, {"RDZV_PORT": "29500"})
        assert proc.returncode == 2 and "RDZV_PORT 29500 is in use" in proc.stderr and not args
    finally:
        holder.close()


# ----------------------------------------------------------------------------- the launch environment


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "3", "WORLD_SIZE": "2"}, "do not fit"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "do not fit"),
        ({"LOCAL_RANK": "-1"}, "do not fit"),
        ({"RANK": "one"}, "integers"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ],
)
def test_rank_variables_without_a_launcher_are_one_sentence(env, words):
    from ranks import launcher_env

    with pytest.raises(ValueError, match=words):
        launcher_env(env)
    assert launcher_env({}) == (0, 1, 0)
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == (1, 2, 0)


@pytest.mark.slow
def test_a_launch_environment_whose_peer_never_comes_is_one_sentence(tmp_path):
    port = free_port()  # nobody listens there
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


def test_each_rank_finds_its_own_gpu_and_ranks_that_would_share_one_are_refused():
    from ranks import cuda_index

    assert cuda_index(local_rank=5, visible=8) == 5  # torchrun: every rank sees the node's GPUs
    assert cuda_index(local_rank=5, visible=1) == 0  # srun --gpus-per-task=1: the one it was given
    with pytest.raises(ValueError, match="LOCAL_RANK 5 has no GPU: 4 are visible"):
        cuda_index(local_rank=5, visible=4)
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


# ----------------------------------------------------------------------------- the torch installed


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

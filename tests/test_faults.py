"""What a hostile user or a failing cluster does to train.py: bad flags, bad data, NaNs, full disks, stalls, a
frozen rank, the SLURM wall (a second run on the same checkpoint: test_faults4.py). Every run is a small subprocess
on 2 CPU cores."""

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from synthetic import write_synthetic

from conftest import (
    FLOOR,
    SHAPE,
    TINY,
    TRAIN,
    VOCAB,
    child_env,
    command,
    first_row,
    on_tokens,
    read_metrics,
    run_train,
    step_seconds,
)
from eval import load_checkpoint

# ----------------------------------------------------------------------- user errors: one sentence, nothing written


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
def test_user_errors_exit_2_in_one_sentence_before_anything_is_written(tmp_path, token_dir, case):
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


# ----------------------------------------------------------------------------- NaN: never saved, rolled back


@pytest.mark.slow
def test_a_diverging_run_never_saves_non_finite_weights(tmp_path, token_dir):
    # without the soft-cap the logits are unbounded: these LRs overflow them within a few steps
    huge = ["--muon_lr", "1e6", "--embed_lr", "1e6", "--head_lr", "1e6", "--scalar_lr", "1e6", "--logit_softcap", "0"]
    args = [
        *on_tokens(token_dir),
        *TINY,
        *huge,
        "--time_limit_min",
        "0.2",
        "--log_every_s",
        "0",
        "--save_every_min",
        "1e-9",
    ]
    proc, _ = run_train(args, tmp_path)  # each rollback halves LRs a million times too high: they run out
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "diverged" and len(summary["rollbacks"]) == 3, summary
    model, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    # the checkpoint and the final validation row say the step of the snapshot they hold, not the last step run
    assert f"holds the weights of step {ckpt['step']}, the last trusted snapshot" in proc.stdout
    assert ckpt["step"] == val[-1]["step"] == summary["weights_step"] < summary["steps"], (ckpt["step"], summary)
    assert ckpt["tokens"] == val[-1]["tokens"] < summary["tokens"]
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------------------- time that is not steps


def synthetic_time_run(tmp_path, extra, budget_min=0.3):
    return ["--checkpoint_path", str(tmp_path / "checkpoint.pt"), *TINY, "--time_limit_min", str(budget_min), *extra]


@pytest.mark.slow
def test_periodic_validation_is_planned_so_the_decay_still_finishes(tmp_path):
    budget = 0.3 * 60
    args = synthetic_time_run(
        tmp_path,
        ["--val_tokens", "131072", "--val_eval_tokens", "131072", "--val_every_min", "0.05", "--decay_frac", "0.4"],
    )  # periodic validation stops where the decay starts: 0.4 leaves 60% of the 18 s for it
    run_train(args, tmp_path, timeout=180)
    rows, val_rows, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert len(val_rows) >= 3 and summary["stop_reason"] == "time_limit"  # periodic ones (until the decay) + final
    assert summary["final_lr_frac"] == rows[-1]["lr_frac"] == FLOOR
    assert 0.8 * budget < summary["train_s"] <= budget + step_seconds(rows) + 1.0


@pytest.mark.slow
def test_a_frozen_process_is_logged_as_a_stall_and_the_decay_still_finishes(tmp_path):
    budget = 0.3 * 60
    proc = subprocess.Popen(
        command(synthetic_time_run(tmp_path, ["--val_tokens", "8192"]), 1),
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        time.sleep(4)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "stall:" in out
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["final_lr_frac"] == rows[-1]["lr_frac"] == FLOOR and summary["stop_reason"] == "time_limit"
    assert summary["train_s"] <= budget + step_seconds(rows) + 1.0


@pytest.mark.slow
def test_the_budget_ends_before_the_slurm_wall_measured_from_the_deadline(tmp_path):
    """A pre-clock phase slowed by 8 s (as a slow step-0 save or a long model build would): training still ends
    --slurm_reserve_s before the job's end, because the budget is taken from the deadline when the clock starts."""
    end = int(time.time()) + 60
    env = {**child_env(), "SLURM_JOB_ID": "4242", "SLURM_JOB_END_TIME": str(end)}
    args = synthetic_time_run(tmp_path, ["--val_tokens", "8192", "--slurm_reserve_s", "25"], budget_min=10)
    slowed = (
        f"import sys, time; sys.path.insert(0, {str(TRAIN.parent)!r}); import launch, train; "
        "build = launch.build_model; launch.build_model = lambda *a: (time.sleep(8), build(*a))[1]; "
        f"train.main({args!r})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", slowed], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the SLURM job ends in" in proc.stdout
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    step_s = step_seconds(rows)
    assert summary["clock_start_unix"] + summary["train_s"] <= end - 25 + step_s + 1.0, (summary, step_s)
    assert summary["budget_s"] < 35 - 8 + 1 and summary["final_lr_frac"] == FLOOR
    assert summary["stop_reason"] == "time_limit"


# ----------------------------------------------------------------------------- bad data mid-run, full disk, two runs


@pytest.mark.slow
def test_sparse_bad_token_ids_are_skipped_counted_and_said_once(tmp_path):
    # 10 ids of 40000 in 600K tokens, placed where the start-up check's sample does not look (its slices are
    # seeded, so they are known): the start-up check passes them, and the loader must catch them as it reads
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(0)
    n, slice_len = 600_000, (1 << 18) // 8
    sampler = np.random.default_rng(0)  # data.check_token_files' sample: head, tail and 6 seeded spots
    sampled = [0, n - slice_len, *sampler.integers(0, n - slice_len, 6).tolist()]
    free = np.ones(n, dtype=bool)
    for start in sampled:
        free[start : start + slice_len] = False
    tokens = rng.integers(3, VOCAB, n).astype("<u2")
    tokens[rng.choice(np.flatnonzero(free), 10, replace=False)] = 40000
    tokens.tofile(folder / "chunk_0001.bin")
    rng.integers(3, VOCAB, 40_000).astype("<u2").tofile(folder / "chunk_0002.bin")
    args = [
        "--data_dir",
        str(folder),
        "--vocab_size",
        str(VOCAB),
        *SHAPE,
        "--seq_len",
        "32",
        "--batch_tokens",
        "2048",
        "--val_tokens",
        "2048",
        "--max_steps",
        "300",
        "--time_limit_min",
        "10",
    ]
    proc, _ = run_train(args, tmp_path)
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 300 and summary["bad_windows"] > 0
    warnings = [line for line in proc.stderr.splitlines() if "warning: rank 0:" in line]  # tqdm shares stderr
    assert len(warnings) == 1 and "id 40000 >= vocab_size 1024" in warnings[0], proc.stderr[-2000:]


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_disk_that_fills_up_under_the_run_keeps_the_last_checkpoint_and_training_goes_on(tmp_path, small_tmpfs):
    """The ~1.2 MB checkpoint (without the bigram table) passes the room check on a 4 MB tmpfs (two of it, side by
    side); then another job fills the disk: every later save fails, said once, and the last whole file stays."""
    args = [
        *TINY,
        "--bigram_mult",
        "0",
        "--checkpoint_path",
        str(small_tmpfs / "ck.pt"),
        "--metrics_path",
        str(tmp_path / "m.jsonl"),
        "--val_tokens",
        "8192",
        "--time_limit_min",
        "0.25",
        "--save_every_min",
        "0.03",
    ]
    proc = subprocess.Popen(
        command(args, 1), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(proc, tmp_path / "m.jsonl")
        filler = small_tmpfs / "another_job"
        with open(filler, "wb") as file:  # leaves less than one checkpoint free
            file.write(b"\1" * (os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize - (1 << 19)))
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert len([line for line in out.splitlines() if "background checkpoint save failed" in line]) == 1
    failed = next(line for line in out.splitlines() if "the final save failed" in line)
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize / 2**20
    size = os.path.getsize(small_tmpfs / "ck.pt") / 2**20
    said = rf"the disk is full: the save writes 1\.\d MiB beside the {size:,.1f} MiB file it replaces, and .* has "
    assert re.search(said + rf"{free:,.1f} MiB free\); the file is left as it was; .* holds step \d+", failed), failed
    assert "Traceback" not in err
    _, _, summary = read_metrics(tmp_path / "m.jsonl")
    assert summary["steps"] > 5  # training went on
    _, ckpt = load_checkpoint(small_tmpfs / "ck.pt")
    assert ckpt["step"] == summary["weights_step"] < summary["steps"] and not list(small_tmpfs.glob("*.tmp"))


# ----------------------------------------------------------------------------- a frozen rank


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
    rest. The first: the frozen-rank test's error when the timeout hit inside DDP's gradient hook (a CI run)."""
    from ranks import lost_contact

    assert lost_contact(RuntimeError(message)) == bool(lost)
    assert lost_contact(torch.distributed.DistError("anything"))


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_storage_that_refuses_locks_is_not_a_path_in_use(tmp_path, monkeypatch, code):
    import errno
    import types

    import paths

    def refuse(handle, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    said = []
    hp = types.SimpleNamespace(checkpoint_path=str(tmp_path / "ck.pt"), metrics_path=str(tmp_path / "metrics.jsonl"))
    monkeypatch.setattr(paths.fcntl, "flock", refuse)
    paths.lock_outputs(hp, said.append).close()
    assert len(said) == 1 and "cannot be locked" in said[0]  # one warning for both outputs
    assert sorted(os.listdir(tmp_path)) == []  # no lock to hold, so no lock file made for one
    monkeypatch.setattr(paths.fcntl, "flock", lambda h, op: (_ for _ in ()).throw(BlockingIOError(errno.EAGAIN, "")))
    with pytest.raises(ValueError, match="in use by another running train.py"):
        paths.lock_outputs(hp, said.append)


def test_each_rank_finds_its_gpu_under_torchrun_and_under_one_gpu_per_task():
    from ranks import cuda_index

    assert cuda_index(local_rank=5, visible=8) == 5  # torchrun: every rank sees the node's GPUs
    assert cuda_index(local_rank=5, visible=1) == 0  # srun --gpus-per-task=1: the one it was given
    with pytest.raises(ValueError, match="LOCAL_RANK 5 has no GPU: 4 are visible"):
        cuda_index(local_rank=5, visible=4)


# ----------------------------------------------------------------------------- class by class: stops, outputs, flags


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


@pytest.fixture
def outputs_hp(tmp_path, token_dir):
    """Hyperparameters resolved as a run on token_dir writing into tmp_path would have them."""
    import config

    hp, _, _ = config.parse_args(["--data_dir", str(token_dir), "--checkpoint_path", str(tmp_path / "ck.pt")])
    return config.resolve(hp, 1)


OUTPUT_CASES = {
    "checkpoint is a data chunk": (lambda hp, tmp, data: {"checkpoint_path": str(data / "chunk_0001.bin")}, "input"),
    "metrics is a data chunk": (lambda hp, tmp, data: {"metrics_path": str(data / "chunk_0002.bin")}, "input"),
    "checkpoint links to a chunk": (
        lambda hp, tmp, data: {"checkpoint_path": link(tmp, data / "chunk_0001.bin")},
        "input",
    ),
    "metrics equals checkpoint": (lambda hp, tmp, data: {"metrics_path": hp.checkpoint_path}, "each needs its own"),
    "checkpoint is a FIFO": (lambda hp, tmp, data: {"checkpoint_path": fifo(tmp)}, "pipe"),
    "checkpoint is a device": (lambda hp, tmp, data: {"checkpoint_path": "/dev/null"}, "device"),
    "checkpoint is empty": (lambda hp, tmp, data: {"checkpoint_path": ""}, "empty"),
    "metrics is blank": (lambda hp, tmp, data: {"metrics_path": "  "}, "empty"),
    "checkpoint is a folder": (lambda hp, tmp, data: {"checkpoint_path": str(tmp)}, "folder"),
    "val_file is the checkpoint": (lambda hp, tmp, data: {"val_file": hp.checkpoint_path}, "input"),
}


def link(tmp, target):
    (tmp / "link.pt").symlink_to(target)
    return str(tmp / "link.pt")


def fifo(tmp):
    os.mkfifo(tmp / "pipe.pt")
    return str(tmp / "pipe.pt")


@pytest.mark.parametrize("case", OUTPUT_CASES.values(), ids=OUTPUT_CASES.keys())
def test_an_output_path_never_destroys_an_input_or_lands_somewhere_unexpected(outputs_hp, tmp_path, token_dir, case):
    import dataclasses

    import paths

    make, words = case
    hp = dataclasses.replace(outputs_hp, **make(outputs_hp, tmp_path, token_dir))
    before = {p.name: p.read_bytes() for p in token_dir.iterdir()}
    with pytest.raises(ValueError, match=words):
        paths.check_outputs(hp, print)
    assert {p.name: p.read_bytes() for p in token_dir.iterdir()} == before


def test_a_symlinked_checkpoint_writes_its_target_and_says_so(outputs_hp, tmp_path):
    import dataclasses

    import paths

    (tmp_path / "runs").mkdir()
    (tmp_path / "latest.pt").symlink_to(tmp_path / "runs" / "ck.pt")
    said = []
    hp = paths.check_outputs(dataclasses.replace(outputs_hp, checkpoint_path=str(tmp_path / "latest.pt")), said.append)
    assert hp.checkpoint_path == str(tmp_path / "runs" / "ck.pt") and "symlink" in said[0]


@pytest.mark.slow
def test_checkpoint_path_naming_a_chunk_is_refused_end_to_end_and_the_chunk_is_kept(tmp_path, token_dir):
    chunk = token_dir / "chunk_0001.bin"
    before = chunk.read_bytes()
    proc, _ = run_train([*on_tokens(token_dir), *TINY, "--checkpoint_path", str(chunk)], tmp_path, expect_rc=2)
    assert "would destroy it" in proc.stderr and "Traceback" not in proc.stderr
    assert chunk.read_bytes() == before


FLAG_CASES = [
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


@pytest.mark.parametrize("argv", FLAG_CASES, ids=" ".join)
def test_every_numeric_flag_has_a_range_checked_before_anything_runs(argv):
    import config

    hp, _, _ = config.parse_args(argv)
    with pytest.raises(ValueError, match=argv[0]):
        config.check_flags(hp)


def test_model_switches_out_of_range_are_one_sentence():
    from model import get_model

    for bad in ({"mlp_ratio": 0}, {"rope_base": 1.0}, {"logit_softcap": -1.0}, {"logit_softcap": float("nan")}):
        with pytest.raises(ValueError, match="mlp_ratio must be"):
            get_model({"vocab_size": 64, "n_layer": 1, "n_head": 1, "n_embd": 8, **bad})


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
def test_a_plan_that_does_not_fit_in_memory_is_refused_before_the_step0_save(tmp_path):
    trained = tmp_path / "checkpoint.pt"
    trained.write_bytes(b"trained weights")
    args = [*SHAPE, "--seq_len", "1024", "--micro_batch", "4096", "--val_tokens", "4096", "--device_memory_gib", "1"]
    proc, _ = run_train(args, tmp_path, expect_rc=2)
    assert "the plan needs" in proc.stderr and "GiB per device" in proc.stderr and "Traceback" not in proc.stderr
    assert trained.read_bytes() == b"trained weights"


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [1, 2])
def test_too_few_steps_for_a_schedule_are_said_and_the_last_step_runs_at_the_floor(tmp_path, max_steps):
    # --decay_frac 0.4: the second of two steps (progress 0.5) is still in the stable phase
    extra = ["--max_steps", str(max_steps), "--val_tokens", "4096", "--decay_frac", "0.4"]
    proc, _ = run_train(synthetic_time_run(tmp_path, extra, budget_min=0.1), tmp_path, timeout=180)
    assert "too few to warm up, hold and decay" in proc.stdout
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == max_steps and summary["final_lr_frac"] == rows[-1]["lr_frac"] == FLOOR
    assert rows[0]["lr_frac"] == (FLOOR if max_steps == 1 else 1.0)  # two steps: one at the full LR, then the floor


@pytest.mark.slow
def test_a_step_that_outlasts_the_whole_budget_is_refused_before_the_clock(tmp_path):
    args = synthetic_time_run(tmp_path, ["--batch_tokens", str(1 << 22), "--val_tokens", "4096"], budget_min=0.1)
    proc, _ = run_train(args, tmp_path, expect_rc=2)
    assert "longer than the whole" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_val_file_that_is_a_training_file_or_its_copy_is_warned_about(tmp_path, token_dir):
    import shutil

    from paths import training_twin

    shutil.copy(token_dir / "chunk_0002.bin", tmp_path / "val.bin")
    assert training_twin(token_dir / "chunk_0002.bin", token_dir).name == "chunk_0002.bin"
    assert training_twin(tmp_path / "val.bin", token_dir).name == "chunk_0002.bin"
    write_synthetic(tmp_path / "other", 1 << 17, vocab_size=VOCAB, n_states=512, seed=1)
    assert training_twin(tmp_path / "other" / "chunk_0001.bin", token_dir) is None


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["one", "all"])
def test_data_truncated_under_a_running_job_is_skipped_or_ends_it_with_the_weights_saved(tmp_path, damaged):
    folder = tmp_path / "tokens"
    write_synthetic(folder, 3 << 17, chunk_tokens=1 << 17, vocab_size=VOCAB, n_states=512)
    files = sorted(folder.glob("chunk_*.bin"))
    args = [*on_tokens(folder), *TINY, "--time_limit_min", "10", "--val_tokens", "4096"]
    proc = subprocess.Popen(
        command(args, 1), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        for path in files if damaged == "all" else files[:1]:  # as a careless copy to shared storage does
            os.truncate(path, 2 * 1000)
        if damaged == "one":
            time.sleep(3.0)  # the other files carry the run on
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert err.count("changed under the run") == (1 if damaged == "one" else 3), err[-3000:]  # once per file
    assert ("stopping: every training file changed under the run" in out) == (damaged == "all")
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == ("signal" if damaged == "one" else "data") and summary["steps"] > 0
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"]


# ----------------------------------------------------------------------------- the launcher never hangs silently


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
    script = Path(__file__).resolve().parents[1] / "submit_slurm.sh"
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

"""Runs longer than one job (resume.py): a run stopped and resumed equals the run that never stopped, bit for bit; a
budget over several jobs decays once; a state killed mid-write leaves the one before it; a state that does not fit
the run is one sentence before the clock, nothing overwritten."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, TINY, child_env, command, on_tokens, patched_train, read_metrics, run_train
from data import BatchLoader
from shards import Deal
from windows import WindowSpec

# keyed to steps, a fixed batch, a sync and a row every step: the same steps whatever the machine's speed
STEPS = [
    "--progress_by",
    "steps",
    "--log_every_s",
    "0",
    "--save_every_min",
    "0",
    "--save_state",
    "--time_limit_min",
    "10",
]
# train.py stopped (as by SIGTERM) after step STOP_AT, then run as torchrun runs it
STOPPING = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import train
step = train.Trainer.train_step
def stopping(trainer):
    stepped = step(trainer)
    if trainer.step == int(os.environ["STOP_AT"]):
        signal.raise_signal(signal.SIGTERM)
    return stepped
train.Trainer.train_step = stopping
train.main(sys.argv[1:])
"""


def stopped_at(step, args, cwd, nproc=1):
    """train.py with args, stopped after `step` steps as a SIGTERM stops it."""
    script = cwd / "stopping.py"
    script.write_text(STOPPING)
    env = {**child_env(), "STOP_AT": str(step)}
    launcher = [sys.executable] if nproc == 1 else command([], nproc)[:-1] + ["--no-python", sys.executable]
    proc = subprocess.run([*launcher, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train_rows(path):
    """The training rows' own numbers: what two runs of the same steps must agree on."""
    rows, _, summary = read_metrics(path)
    return [(r["step"], r["train_loss"], r["lr_frac"], r["tokens"]) for r in rows], summary


def weights(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_run_stopped_and_resumed_equals_the_run_that_never_stopped_bit_for_bit(tmp_path, token_dir, nproc):
    args = [*on_tokens(token_dir), *TINY, *STEPS, "--max_steps", "16", "--device", "cpu"]
    (tmp_path / "whole").mkdir()
    (tmp_path / "twice").mkdir()
    run_train(args, tmp_path / "whole", nproc)
    stopped_at(7, args, tmp_path / "twice", nproc)
    assert weights(tmp_path / "twice" / "checkpoint.pt") != {}  # the stop's checkpoint, and the state beside it
    proc, _ = run_train(args, tmp_path / "twice", nproc)
    assert "resume: step 7 of the run in " in proc.stdout and "this is job 2" in proc.stdout
    whole, whole_summary = train_rows(tmp_path / "whole" / "metrics.jsonl")
    twice, summary = train_rows(tmp_path / "twice" / "metrics.jsonl")
    assert twice == whole and len(whole) == 16
    a, b = weights(tmp_path / "whole" / "checkpoint.pt"), weights(tmp_path / "twice" / "checkpoint.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [job["steps"] for job in summary["jobs"]] == [7, 9] and summary["val_loss"] == whole_summary["val_loss"]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "twice" / "metrics.jsonl")[0]}
    first, before = rows[8], rows[7]  # the resumed job's first row: its rate is its own step's, not the run's tokens
    own_rate = (first["tokens"] - before["tokens"]) / (first["elapsed_s"] - before["elapsed_s"])
    assert first["tokens_per_s"] <= 2 * own_rate


# each job's wall JOB_S after its checks began (as SLURM_JOB_END_TIME would say), less its reserve of 3 s: ~9-12 s of
# training a job here, so a 30 s budget takes 3 or 4 of them however long the interpreter took to start
JOB_S = 16.0
WALL = f"launch.training_deadline = lambda hp, rank, device, world, say: time.time() + {JOB_S} - hp.slurm_reserve_s"


@pytest.mark.slow
def test_a_budget_over_three_jobs_decays_once_and_ends_at_the_floor(tmp_path, token_dir):
    """Each job's wall comes before the run's 30 s budget is trained: it trains up to the wall less
    --slurm_reserve_s, saves the state and exits 0 (wall); the next goes on, as submit_slurm.sh's requeue does, until
    one ends on the budget. The LR falls once, to the floor."""
    args = [*on_tokens(token_dir), *TINY, "--budget_spans_jobs", "--time_limit_min", "0.5"]
    args += ["--slurm_reserve_s", "3", "--save_every_min", "0.05", "--log_every_s", "0.5"]
    jobs = []
    while not jobs or jobs[-1] == "wall":
        proc, _ = patched_train(tmp_path, WALL, args)
        assert proc.returncode == 0 and len(jobs) < 8, proc.stderr[-3000:]
        jobs.append(read_metrics(tmp_path / "metrics.jsonl")[2]["stop_reason"])
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    lr = [r["lr_frac"] for r in rows]
    assert len(jobs) >= 3 and [job["stop_reason"] for job in summary["jobs"]] == jobs
    # at the floor, or a sliver above it: steps of ~12 ms that slow down on a loaded machine after the last sync can
    # reach the budget before the planned floor step, which may then not start (no step starts past the budget)
    assert all(b <= a for a, b in zip(lr, lr[1:])) and lr[0] == 1.0 and 0.15 <= summary["final_lr_frac"] < 0.16
    assert summary["stop_reason"] == "time_limit" and 29.0 < summary["train_s"] <= 31.0
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps))  # no step trained twice: each job's rows go on from the last one's
    again = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert again.returncode == 0 and "has finished (time_limit" in again.stdout  # a spent budget: nothing to do


# a state save killed part-way: the second save's files written, then SIGKILL before it is named
KILLED = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
import resume, train
complete, saves = resume.StateWriter._complete, []
def killed_on_the_second(self, folder, meta):
    saves.append(folder)
    if len(saves) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    complete(self, folder, meta)
resume.StateWriter._complete = killed_on_the_second
train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_job_killed_while_writing_the_state_leaves_the_one_before_usable(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, *STEPS[:-2], "--time_limit_min", "0.3", "--save_every_min", "0.02"]
    proc = subprocess.run([sys.executable, "-c", KILLED, *args], cwd=tmp_path, env=child_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    root = tmp_path / "checkpoint.pt.state"
    named = json.loads((root / "latest.json").read_text())
    assert len([p for p in root.iterdir() if p.name.startswith("step-")]) == 2  # the killed one is there, unnamed
    proc, _ = run_train(args, tmp_path)
    assert f"resume: step {named['step']} of the run" in proc.stdout
    assert len([p for p in root.iterdir() if p.name.startswith("step-")]) == 1  # the unnamed one removed


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory, token_dir):
    """A run stopped after 5 steps, its checkpoint and state: (folder, its flags)."""
    folder = tmp_path_factory.mktemp("saved")
    args = [*on_tokens(token_dir), *TINY, *STEPS, "--max_steps", "40"]
    stopped_at(5, args, folder)
    return folder, args


def refused(folder, args, expect_rc=2):
    """train.py with args in folder: refused in one sentence, nothing of its files changed."""
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".py"}
    proc = subprocess.run(command(args, 1), cwd=folder, env=child_env(), capture_output=True, text=True)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == expect_rc and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix != ".py"}
    assert after == before
    return errors


@pytest.mark.parametrize(
    "change, said",
    [
        (["--n_embd", "32"], "the state was saved by a run with --n_embd 64 (not 32)"),
        (["--backout", "false"], "the state holds another model: backout differ"),
        (["--muon_lr", "0.05"], "the state was saved by a run with --muon_lr 0.025 (not 0.05)"),
        (["--max_steps", "50"], "--max_steps 40 (not 50)"),
    ],
)
def test_a_state_of_another_shape_or_recipe_is_one_sentence(saved_state, change, said):
    folder, args = saved_state
    errors = refused(folder, [*args, *change])
    assert len(errors) == 1 and said in errors[0] and "--resume none" in errors[0], errors


def test_a_state_of_other_data_is_one_sentence(saved_state, tmp_path):
    folder, args = saved_state
    other = tmp_path / "other"
    other.mkdir()
    (np.arange(2 << 17) % 1000).astype("<u2").tofile(other / "chunk_0001.bin")
    errors = refused(folder, [*args, "--data_dir", str(other)])
    assert len(errors) == 1 and "other training files" in errors[0], errors


def test_a_damaged_state_is_one_sentence_and_a_spent_budget_ends_with_nothing_written(saved_state, tmp_path):
    folder, args = saved_state
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(folder), str(copy)], check=True)
    state = json.loads((copy / "checkpoint.pt.state" / "latest.json").read_text())["folder"]
    shard = copy / "checkpoint.pt.state" / state / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    errors = refused(copy, args)
    assert len(errors) == 1 and "cannot be read" in errors[0], errors
    meta = copy / "checkpoint.pt.state" / state / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "stop_reason": "time_limit"}))
    assert refused(copy, args, expect_rc=0) == []


def test_resume_none_starts_afresh_and_a_missing_state_path_is_one_sentence(saved_state, tmp_path):
    folder, args = saved_state
    errors = refused(folder, [*args, "--resume", str(tmp_path / "nowhere.pt")])
    assert len(errors) == 1 and "no training state there" in errors[0], errors
    proc, _ = run_train([*args, "--resume", "none", "--checkpoint_path", str(tmp_path / "fresh.pt")], folder)
    assert "resume:" not in proc.stdout and read_metrics(tmp_path / "metrics.jsonl")[2]["steps"] == 40


@pytest.mark.slow
def test_a_state_of_two_ranks_is_refused_by_one_and_a_second_run_on_it_by_the_locks(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, *STEPS, "--max_steps", "100000", "--device", "cpu"]
    stopped_at(4, args, tmp_path, nproc=2)
    errors = refused(tmp_path, args)
    assert len(errors) == 1 and "saved by 2 ranks, and this run has 1" in errors[0], errors
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    first = subprocess.Popen(command(args, 2), cwd=tmp_path, env=child_env(), **quiet)  # resumed: up to 10 min
    try:
        deadline = time.time() + 90
        while time.time() < deadline and max(r["step"] for r in rows_so_far(tmp_path / "metrics.jsonl")) <= 4:
            time.sleep(0.5)
        errors = [line for line in refused_while_running(tmp_path, args) if line.startswith("error: ")]
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)
    assert len(errors) == 1 and "is in use by another running train.py" in errors[0], errors


def rows_so_far(path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if "train_loss" in r] or [{"step": 0}]


def refused_while_running(folder, args):
    """A second train.py on a running run's files (2 ranks, as it runs): its stderr lines (torchrun adds its own
    report of a rank's exit 2)."""
    proc = subprocess.run(command(args, 2), cwd=folder, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc.stderr.splitlines()


def test_the_loader_resumed_at_any_place_serves_what_the_whole_loader_serves_next():
    """Places inside a block, at a block's end and across an epoch's end, plain and document-aligned."""
    tokens = np.random.default_rng(0).integers(2, 1000, 30_000).astype("<u2")
    tokens[::37] = 1  # documents of 37 tokens start with BOS (1)
    for doc in (False, True):
        spec = WindowSpec(31, vocab_size=1024, doc_aligned=doc, bos_id=1 if doc else None)
        deal = Deal(1, 2, seed=3, block_windows=5)
        with BatchLoader([tokens], spec, 7, deal, prefetch_tokens=0) as whole:
            batches, places = [], []
            while whole.epoch < 2:
                places.append(whole.position)
                batches.append(next(whole))
        for i in (0, 1, 13, len(batches) // 2, len(batches) - 5):
            with BatchLoader([tokens], spec, 7, deal, prefetch_tokens=0, start=places[i]) as resumed:
                for x, y in batches[i : i + 5]:
                    a, b = next(resumed)
                    assert torch.equal(a, x) and torch.equal(b, y), (doc, i, places[i])
        assert places[-1].epoch == 1 and places[1].epoch == 0 and len({p.ordinal for p in places}) > 10

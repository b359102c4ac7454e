"""Fixtures and helpers shared by the test modules (no test module imports another): the event's plan inputs, token
folders, train.py as a subprocess (plain, patched, on several ranks), metrics files, mounts, gloo groups."""

import contextlib
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from synthetic import write_synthetic
import plan
import config

ROOT = Path(__file__).resolve().parents[1]
FLOOR = config.Hyperparameters().min_lr_frac  # the LR fraction of every run's last step (--min_lr_frac)

VOCAB = 1024  # the synthetic chain's ids stay below this
# the scored event's plan inputs: 32 B300 ranks, 10 minutes, the organizers' --max_steps 5000 and --seq_len 1024
EVENT_SPEC = {
    "kind": "cuda",
    "world_size": 32,
    "budget_s": 600.0,
    "max_steps": 5000,
    "seq_len": 1024,
    "vocab_size": 32000,
    "batch_size": 8,
    "micro_batch": None,
    "batch_tokens": None,
    "matmul_rate": 2250e12,
    "efficiency": 0.4,
    "memory_bytes": 288 * 2**30,
    "bf16": True,
}


@pytest.fixture
def event_plan():
    """plan.make_plan for the event, with overrides: (plan, table)."""

    def make(model="auto", shape=None, tokens_per_param=20.0, **overrides):
        return plan.make_plan(
            model=model, shape=shape, tokens_per_param=tokens_per_param, **{**EVENT_SPEC, **overrides}
        )

    return make


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Two event-format chunk files of the synthetic chain (ids < VOCAB): write_synthetic, as a user would."""
    folder = tmp_path_factory.mktemp("tokens")
    write_synthetic(folder, 2 << 17, chunk_tokens=1 << 17, vocab_size=VOCAB, n_states=512)
    return folder


@pytest.fixture
def token_copy(tmp_path, token_dir):
    """A copy of token_dir's files in tmp_path/data, for a test that links to them, changes them or guards them."""
    data = tmp_path / "data"
    shutil.copytree(token_dir, data)
    return data


def train_tokenizer(folder, sentences, vocab_size):
    """A small SentencePiece BPE model with the event data's ids (unk 0, BOS 1, EOS 2), trained on sentences."""
    import sentencepiece

    (folder / "text.txt").write_text("\n".join(sentences * 3) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "text.txt"),
        model_prefix=str(folder / "tok"),
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return folder / "tok.model", sentencepiece.SentencePieceProcessor(model_file=str(folder / "tok.model"))


# ----------------------------------------------------------------------------- train.py as a subprocess

TRAIN = ROOT / "train.py"
SHAPE = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64"]
# step-keyed runs fix tokens per step: otherwise the plan grows it until the budget fits in --max_steps
TINY = [
    *SHAPE,
    "--seq_len",
    "32",
    "--batch_size",
    "8",
    "--batch_tokens",
    "256",
    "--val_tokens",
    "4096",
    "--val_eval_tokens",
    "2048",
]
LONG_BUDGET = ["--time_limit_min", "10"]  # never binding: the run is keyed to --max_steps or a signal


# ----------------------------------------------------------------------------- helpers


def child_env():
    """One intra-op thread per process: with 2 cores shared by the loader thread and other jobs, a second
    OpenMP thread made a tiny run ~20x slower here. No inherited torchrun variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def command(args, nproc):
    if nproc == 1:
        return [sys.executable, str(TRAIN), *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(TRAIN),
        *args,
    ]


def run_train(args, cwd, nproc=1, timeout=300, expect_rc=0):
    start = time.perf_counter()
    proc = subprocess.run(
        command(args, nproc), cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - start
    assert proc.returncode == expect_rc, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, wall


def patched_train(tmp_path, patch, args, env=None, nproc=1):
    """train.main(args) in a child process after `patch` (Python run first, with os, time, checkpoint, launch and
    train imported), with env's variables added to child_env()'s; nproc > 1: in each of nproc torchrun ranks (a rank
    reads its own from os.environ["RANK"]). Returns (process, unix time right before it started)."""
    code = (
        f"import os, sys, time; sys.path.insert(0, {str(TRAIN.parent)!r}); import checkpoint, launch, train\n"
        f"{patch}\ntrain.main({args!r})"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    launcher = [*torchrun, "--no-python"] if nproc > 1 else []
    started = time.time()
    proc = subprocess.run(
        [*launcher, sys.executable, "-c", code],
        cwd=tmp_path,
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, started


def synthetic_time_run(tmp_path, extra, budget_min=0.3):
    """The flags of a tiny run on the built-in synthetic data, keyed to a budget of budget_min minutes."""
    return ["--checkpoint_path", str(tmp_path / "checkpoint.pt"), *TINY, "--time_limit_min", str(budget_min), *extra]


def read_metrics(path):
    """(training rows, validation rows, summary) from a metrics file, checking the summary is the last line."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert rows and rows[-1].get("summary") is True, rows[-3:]
    train_rows = [r for r in rows[:-1] if "lr_frac" in r]
    val_rows = [r for r in rows[:-1] if "val_loss" in r]
    for r in train_rows:
        assert {"step", "elapsed_s", "lr_frac", "train_loss", "tokens"} <= r.keys()
    return train_rows, val_rows, rows[-1]


def first_row(proc, path, timeout=120):
    """Poll for the first complete metrics line; returns (time seen, row)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if path.exists():
            text = path.read_text()
            if "\n" in text:
                return time.perf_counter(), json.loads(text.split("\n", 1)[0])
        assert proc.poll() is None, f"train.py exited early: rc {proc.returncode}\n{proc.stderr.read()[-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no metrics row in {timeout} s")


def step_seconds(rows):
    """Median seconds per optimizer step between logged rows after step 2 (compile and warm-up excluded)."""
    rows = [r for r in rows if r["step"] >= 2]
    per_step = [(b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]) for a, b in zip(rows, rows[1:])]
    return float(np.median(per_step))


def on_tokens(token_dir):
    """The flags that train on the token_dir fixture's files."""
    return ["--data_dir", str(token_dir), "--vocab_size", str(VOCAB)]


# ----------------------------------------------------------------------------- mounts (root only: else a skip)


@contextlib.contextmanager
def mounted(folder, *how):
    """`mount HOW folder` (the folder made first) for the with block, unmounted after it; the test is skipped where
    this machine cannot mount (mounting needs root)."""
    folder.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    done = subprocess.run(["mount", *how, str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here (needs root): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def tmpfs(folder, size):
    """A tmpfs of `size` (as mount reads it: 256k, 2M) at folder: a disk that fills up."""
    return mounted(folder, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def bind_mount(source, folder):
    """The folder source seen again at folder: a second path to the same files that resolving does not undo."""
    return mounted(folder, "--bind", str(source))


# ----------------------------------------------------------------------------- loader windows


def full_windows(x, y):
    """(rows, seq_len + 1) windows from a batch, checking y is x shifted by one."""
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape
    assert torch.equal(x[:, 1:], y[:, :-1])
    return torch.cat([x, y[:, -1:]], dim=1).numpy()


def epoch0_windows(loader):
    """Every window a loader yields before its first wrap to epoch 1."""
    windows = []
    while True:
        batch = next(loader)
        if loader.epoch > 0:
            return np.concatenate(windows)
        windows.append(full_windows(*batch))


def free_port():
    """A free localhost port for a gloo process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank, world_size, port):
    """Join a gloo group of world_size spawned processes on localhost, one torch thread each (CI has 2 cores)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)

"""The fourth fault round (issue 44), classes 1, 2, 3 and 5: data that changes under the run into something with no
usable window, a log stream that blocks instead of going away, two runs on one checkpoint (bundle.py's links are in
test_ship.py). Every run is a small subprocess on 2 CPU cores."""

import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import paths
import streams
import windows
from checkpoint import save_checkpoint
from conftest import TINY, VOCAB, child_env, command, first_row, on_tokens, read_metrics
from data import BatchLoader
from eval import load_checkpoint
from shards import Deal
from synthetic import write_synthetic
from windows import DataChanged, WindowSpec

# ----------------------------------------------------------------------------- 1. data that changes under the run


def doc_files(folder, n_files=3, tokens=4000):
    """Token files with a BOS every 40 tokens, every id < VOCAB: usable with and without --doc_aligned."""
    folder.mkdir()
    for i in range(n_files):
        ids = (np.arange(tokens) % 500 + 2).astype("<u2")
        ids[::40] = 1
        ids.tofile(folder / f"chunk_{i + 1:04d}.bin")
    return sorted(folder.glob("chunk_*.bin"))


def rewrite_in_place(files, ids):
    """Each file overwritten through its own inode, as a re-tokenisation or an in-place sync into the live folder."""
    for path in files:
        with open(path, "r+b") as file:
            file.write(ids(os.path.getsize(path) // 2).astype("<u2").tobytes())


def replaced(make):
    def change(files, monkeypatch):
        for path in files:
            path.unlink()
            make(path)

    return change


class Abort(BaseException):
    """Not an Exception: what a thread can die of that `except Exception` misses."""


def reader_fails(error):
    def change(files, monkeypatch):
        def fail(self, index, start, end):
            raise error

        monkeypatch.setattr(windows.WindowReader, "windows", fail)

    return change


DATA_CHANGES = {
    "ids >= vocab_size rewritten in place": (
        lambda files, mp: rewrite_in_place(files, lambda n: np.full(n, VOCAB + 7)),
        False,
        f"holds a token id >= vocab_size {VOCAB}",
    ),
    "rewritten without BOS (--doc_aligned)": (
        lambda files, mp: rewrite_in_place(files, lambda n: np.arange(n) % 500 + 2),
        True,
        "too sparse for --doc_aligned",
    ),
    "rewritten shorter": (lambda files, mp: [os.truncate(p, 200) for p in files], False, "changed under the run"),
    "a folder in its place": (replaced(os.mkdir), False, "changed under the run"),
    "a FIFO in its place": (replaced(os.mkfifo), False, "changed under the run"),
    "the reader raises MemoryError": (reader_fails(MemoryError("cannot allocate")), False, "MemoryError"),
    "the reader raises a BaseException": (reader_fails(Abort("gone")), False, "Abort: gone"),
}


def served_until_it_stops(loader, timeout=30, most=5000):
    """(batches served, the error next() ended with); a loader that blocks or never stops fails the test."""
    result = []

    def consume():
        batches = []
        try:
            while len(batches) < most:
                batches.append(next(loader))
        except BaseException as error:
            result.append((batches, error))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"the loader neither served {most} batches nor stopped in {timeout} s: it blocks"
    return result[0]


@pytest.mark.parametrize("case", DATA_CHANGES.values(), ids=DATA_CHANGES.keys())
def test_every_way_the_data_stops_yielding_windows_is_data_changed(tmp_path, monkeypatch, case):
    change, doc_aligned, words = case
    monkeypatch.setattr(windows, "MAX_OPEN_FILES", 1)  # files are reopened, as a folder of more than 64 files is
    files = doc_files(tmp_path / "data")
    arrays = [np.memmap(path, dtype="<u2", mode="r") for path in files]
    spec = WindowSpec(15, doc_aligned=doc_aligned, bos_id=1, vocab_size=VOCAB)
    loader = BatchLoader(arrays, spec, 4, Deal(0, 1, block_windows=8))
    try:
        next(loader)
        change(files, monkeypatch)
        batches, error = served_until_it_stops(loader)
        assert isinstance(error, DataChanged) and words in str(error), repr(error)
        assert all(int(x.max()) < VOCAB and int(y.max()) < VOCAB for x, y in batches)  # no bad id reaches the model
        with pytest.raises(DataChanged) as again:  # and every call after it, not "closed" or a wait
            next(loader)
        assert again.value is error
    finally:  # a loader thread stuck in a read would hold close() too: the test fails, it does not hang
        threading.Thread(target=loader.close, daemon=True).start()


def bad_ids_mid_run(tmp_path, nproc):
    """A run (nproc ranks) whose every data file is rewritten in place with ids >= vocab_size once it trains:
    (exit code, stdout, stderr)."""
    folder = tmp_path / "tokens"
    write_synthetic(folder, 3 << 17, chunk_tokens=1 << 17, vocab_size=VOCAB, n_states=512)
    args = [*on_tokens(folder), *TINY, "--time_limit_min", "10", "--save_every_min", "0"]
    proc = subprocess.Popen(
        command(args, nproc), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        rewrite_in_place(sorted(folder.glob("chunk_*.bin")), lambda n: np.full(n, VOCAB + 7))
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_data_rewritten_with_ids_past_the_vocabulary_mid_run_stops_saves_and_validates(tmp_path, nproc):
    rc, out, err = bad_ids_mid_run(tmp_path, nproc)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "stopping: " in out and "the data changed under the run" in out + err and f">= vocab_size {VOCAB}" in err
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "data" and summary["steps"] > 0 and summary["bad_windows"] > 0
    assert summary["world_size"] == nproc
    assert val[-1]["step"] == summary["steps"] and summary["val_loss"] == val[-1]["val_loss"]  # the final validation
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"]  # the last whole step, not step 0


# ----------------------------------------------------------------------------- 2. a log stream that blocks


def full_pipe():
    """(read end, write end) of a one-page pipe, its write end non-blocking (as a launcher may leave a log stream)
    and full: no reader takes anything until the test drains it."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETFL, fcntl.fcntl(write, fcntl.F_GETFL) | os.O_NONBLOCK)
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    while True:
        try:
            os.write(write, b"." * 512)
        except BlockingIOError:
            return read, write


def drain(fd):
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    taken = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            taken += chunk
    except BlockingIOError:
        pass
    return taken


TEXT_LAYERS = {  # Python's own stdout: block-buffered, or with PYTHONUNBUFFERED / -u a raw descriptor under the text
    "buffered": lambda fd: os.fdopen(fd, "w", closefd=False),
    "unbuffered": lambda fd: io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True),
}


@pytest.mark.parametrize("layer", TEXT_LAYERS.values(), ids=TEXT_LAYERS.keys())
def test_a_write_that_would_block_is_dropped_counted_and_the_stream_stays(monkeypatch, layer):
    read, write = full_pipe()
    try:
        out = streams.LogStream(layer(write), "stdout", write, [])
        assert out.write("x" * 300) == 300 and out.dropped == 300 and out.lost is None
        out.flush()  # nothing kept back for a later flush (or Python's at exit) to fail on
        assert len(drain(read)) == 4096  # the filler only
        assert out.write("y" * 5000) == 5000  # more than the page: part is written, the rest dropped
        written = drain(read)
        assert set(written) <= {ord("y")} and out.dropped == 300 + 5000 - len(written) and len(written) >= 4096 - 512
        out.write("z\n")
        assert drain(read) == b"z\n" and out.dropped == 5300 - len(written)  # a reader that caught up gets it all
        monkeypatch.setattr(sys, "stdout", out)
        assert f"stdout ({out.dropped:,} bytes dropped: would block)" in streams.lost_log_streams()
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.slow
def test_a_run_whose_log_pipe_is_non_blocking_and_full_trains_saves_and_says_what_it_dropped(tmp_path):
    read, write = full_pipe()
    env = {k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"}  # buffered, as most runs are
    args = [*TINY, "--max_steps", "6", "--time_limit_min", "10"]
    try:
        proc = subprocess.run(command(args, 1), cwd=tmp_path, env=env, stdout=write, stderr=write, timeout=300)
        assert len(drain(read)) == 4096  # nothing got through, and nothing waited for the reader
    finally:
        os.close(read)
        os.close(write)
    assert proc.returncode == 0  # not 120: Python's flush at exit has nothing left to fail on
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 6 and val[-1]["step"] == 6
    assert load_checkpoint(tmp_path / "checkpoint.pt")[1]["step"] == 6
    dropped = [entry for entry in summary["lost_streams"] if entry.endswith("bytes dropped: would block)")]
    assert [entry.split()[0] for entry in dropped] == ["stdout", "stderr"], summary["lost_streams"]


# ----------------------------------------------------------------------------- 3. two runs on one checkpoint


@pytest.fixture
def own_locks(monkeypatch):
    """paths.OUTPUT_LOCKS for this test alone, released after it (a run holds its locks until it exits)."""
    held = []
    monkeypatch.setattr(paths, "OUTPUT_LOCKS", held)
    yield held
    for handle in held:
        handle.close()


def outputs(folder, checkpoint, metrics):
    return types.SimpleNamespace(checkpoint_path=str(folder / checkpoint), metrics_path=str(folder / metrics))


def test_every_output_is_owned_by_one_run_and_the_advice_points_at_no_clash(tmp_path, own_locks):
    paths.lock_outputs(outputs(tmp_path, "ck.pt", "m.jsonl"), print).close()
    save_checkpoint({"model": {}, "step": 1}, str(tmp_path / "ck.pt"))  # renamed over: the lock must outlive it
    with pytest.raises(ValueError) as refused:
        paths.lock_outputs(outputs(tmp_path, "ck.pt", "other.jsonl"), print)
    assert str(refused.value) == (
        f"--checkpoint_path {tmp_path / 'ck.pt'} is in use by another running train.py; wait for it to end, or give "
        f"this run its own --checkpoint_path and --metrics_path"
    )
    assert not (tmp_path / "other.jsonl").exists()  # refused before anything was written
    clashes = {  # the same metrics, or one run's output as the other's other output
        "metrics_path": [("ck2.pt", "m.jsonl"), ("ck2.pt", "ck.pt")],
        "checkpoint_path": [("m.jsonl", "m2.jsonl")],
    }
    for flag, pairs in clashes.items():
        for checkpoint, metrics in pairs:
            with pytest.raises(ValueError, match=f"--{flag} .* is in use by another running train.py"):
                paths.lock_outputs(outputs(tmp_path, checkpoint, metrics), print)
    assert paths.lock_file(str(tmp_path / "ck.pt")) == str(tmp_path / ".ck.pt.lock")
    for handle in own_locks:  # the first run ends: its paths are free again, the lock files left beside them
        handle.close()
    paths.lock_outputs(outputs(tmp_path, "ck.pt", "other.jsonl"), print).close()


@pytest.mark.slow
def test_a_second_run_on_the_same_checkpoint_with_another_metrics_path_is_refused_before_writing(tmp_path):
    args = [*TINY, "--val_tokens", "8192", "--time_limit_min", "10"]
    first = subprocess.Popen(
        command(args, 1), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(first, tmp_path / "metrics.jsonl")
        second = subprocess.run(
            command([*args, "--metrics_path", "second.jsonl", "--max_steps", "2"], 1),
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr[-2000:]
    assert "--checkpoint_path checkpoint.pt is in use by another running train.py" in second.stderr
    assert not (tmp_path / "second.jsonl").exists()
    assert first.returncode == 0
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"] > 0 and Path(ckpt["config"]["metrics_path"]).name == "metrics.jsonl"

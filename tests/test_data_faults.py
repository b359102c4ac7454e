"""What bad or changing data does to a run: token ids past the vocabulary (sparse, or written over the files mid-run),
files truncated, replaced or unreadable under the run, data in which no window can be formed, more files than the
open-file limit allows, a validation file that is a training file. Each is skipped and counted, or ends the run with
the weights saved and validated, or is one sentence before anything is written; a loader never blocks on it. Whole
runs are small subprocesses on 2 CPU cores, in the slow tier."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import windows
from conftest import ROOT, SHAPE, TINY, VOCAB, child_env, command, first_row, on_tokens, read_metrics, run_train
from data import BatchLoader
from eval import load_checkpoint
from shards import Deal
from synthetic import write_synthetic
from windows import DataChanged, WindowSpec


# ----------------------------------------------------------------------------- ids past the vocabulary


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


# ----------------------------------------------------------------------------- data that changes under the run


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


# ----------------------------------------------------------------------------- data in which no window can be formed


def late_bos_data(folder, files=3, tokens=20_000):
    """Files whose only BOS is 5 tokens from the end: BOS is detected (rate 5e-5), but no window can start at one."""
    import numpy as np

    folder.mkdir()
    for i in range(files):
        ids = (np.arange(tokens) % 900 + 3).astype("<u2")
        ids[-5] = 1
        ids.tofile(folder / f"chunk_{i:04d}.bin")
    return folder


def test_data_in_which_no_window_can_be_formed_fails_when_the_loader_is_made(tmp_path):
    import numpy as np

    from data import BatchLoader, load_token_data
    from shards import Deal
    from windows import WindowSpec

    data = load_token_data(late_bos_data(tmp_path / "data"), 1024, 64, 1000)
    with pytest.raises(ValueError, match="too sparse for --doc_aligned"):
        BatchLoader(data.train, WindowSpec(64, doc_aligned=True, bos_id=data.bos_id), 4, Deal(0, 1))
    bad = [np.full(5000, 700, dtype="<u2")]  # every id >= vocab_size, in arrays the start-up check never sampled
    with pytest.raises(ValueError, match="holds a token id >= vocab_size 500"):
        BatchLoader(bad, WindowSpec(64, vocab_size=500), 4, Deal(0, 1))


@pytest.mark.slow
def test_a_run_in_which_no_window_can_be_formed_keeps_the_existing_checkpoint(tmp_path):
    data = late_bos_data(tmp_path / "data")
    (tmp_path / "checkpoint.pt").write_bytes(b"a good checkpoint of an earlier run")
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--doc_aligned", "--max_steps", "2"]
    proc = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "too sparse for --doc_aligned" in proc.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"a good checkpoint of an earlier run"


# ----------------------------------------------------------------------------- many data files


def many_files(folder, n_files, tokens=5000):
    import numpy as np

    folder.mkdir()
    for i in range(n_files):
        (np.arange(i, i + tokens) % 900 + 3).astype("<u2").tofile(folder / f"chunk_{i:05d}.bin")
    return folder


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_the_reader_holds_a_bounded_number_of_files_open(tmp_path):
    from data import BatchLoader, load_token_data
    from shards import Deal
    from windows import WindowSpec
    from windows import MAX_OPEN_FILES

    data = load_token_data(many_files(tmp_path / "data", 150, tokens=600), 1024, 15, 0)
    before = open_fds()
    with BatchLoader(data.train, WindowSpec(15), 16, Deal(0, 1), prefetch_tokens=0) as loader:
        for _ in range(200):  # 3,200 windows: most of the 150 files' 5,600 blocks-worth are read
            next(loader)
            assert open_fds() - before <= MAX_OPEN_FILES + 2
        assert len(loader.reader._files) == MAX_OPEN_FILES
    assert open_fds() == before


def limited(soft, hard):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_folder_of_more_files_than_the_soft_limit_trains_and_check_agrees(tmp_path):
    data = many_files(tmp_path / "data", 400)
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--max_steps", "2"]
    run = subprocess.run(
        command(args, 1),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited(256, 4096),
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "open-file limit raised from 256 to 720 for 400 files" in run.stdout
    check = subprocess.run(
        [sys.executable, str(ROOT / "data_cli.py"), "check", str(data), "--vocab_size", "1024", "--seq_len", "32"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited(256, 4096),
    )
    assert check.returncode == 0 and "a run here: open-file limit raised from 256 to 720" in check.stdout


@pytest.mark.slow
def test_a_hard_limit_too_low_for_the_files_is_one_sentence_in_the_run_and_in_check(tmp_path):
    data = many_files(tmp_path / "data", 400)
    (tmp_path / "checkpoint.pt").write_bytes(b"an earlier run's")
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--max_steps", "2"]
    run = subprocess.run(
        command(args, 1),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited(300, 300),
    )
    check = subprocess.run(
        [sys.executable, str(ROOT / "data_cli.py"), "check", str(data), "--vocab_size", "1024", "--seq_len", "32"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited(300, 300),
    )
    for proc in (run, check):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "the 400 token files need about 720 open files, but this process may open at most 300" in proc.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"an earlier run's"


# ---------------------------------------------------------------------------- a validation file that is a training file


def test_a_val_file_that_is_a_training_file_or_its_copy_is_warned_about(tmp_path, token_dir):
    import shutil

    from paths import training_twin

    shutil.copy(token_dir / "chunk_0002.bin", tmp_path / "val.bin")
    assert training_twin(token_dir / "chunk_0002.bin", token_dir).name == "chunk_0002.bin"
    assert training_twin(tmp_path / "val.bin", token_dir).name == "chunk_0002.bin"
    write_synthetic(tmp_path / "other", 1 << 17, vocab_size=VOCAB, n_states=512, seed=1)
    assert training_twin(tmp_path / "other" / "chunk_0001.bin", token_dir) is None

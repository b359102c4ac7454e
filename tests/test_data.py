"""Tests for data.py: file checks, rank-disjoint shuffled batches, validation split, synthetic entropy, CLI."""
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from data import (BatchLoader, _doc_window_starts, check_token_files, find_token_files, load_token_data,  # noqa: E402
                  synthetic_entropy_nats, synthetic_tokens, val_batches, write_synthetic)

torch.set_num_threads(1)


def write_tokens(path, tokens):
    np.asarray(tokens).astype("<u2").tofile(path)
    return path


def position_files(folder, sizes, first=2):
    """chunk files whose tokens are all distinct (consecutive ints from `first`), so a token names its position."""
    arrays, next_id = [], first
    for i, n in enumerate(sizes):
        arrays.append(np.arange(next_id, next_id + n))
        write_tokens(folder / f"chunk_{i + 1:04d}.bin", arrays[-1])
        next_id += n
    return arrays


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


# --- file checks -------------------------------------------------------------------------------------------

def test_missing_folder_and_no_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_token_files(tmp_path / "nope")
    write_tokens(tmp_path / "val.bin", np.arange(100))  # not a chunk file
    with pytest.raises(FileNotFoundError, match=r"no chunk_\*\.bin"):
        find_token_files(tmp_path)


def test_files_sorted_by_name(tmp_path):
    for i in (3, 1, 2):
        write_tokens(tmp_path / f"chunk_{i:04d}.bin", np.arange(10))
    assert [p.name for p in find_token_files(tmp_path)] == ["chunk_0001.bin", "chunk_0002.bin", "chunk_0003.bin"]


@pytest.mark.parametrize("case, match", [
    ("odd", "odd size"),
    ("short", "fewer than one window"),
    ("id_at_start", ">= --vocab_size 1000"),
    ("id_at_end", ">= --vocab_size 1000"),
    ("id_small_file", ">= --vocab_size 1000"),
])
def test_bad_file_named_in_error(tmp_path, case, match):
    good = write_tokens(tmp_path / "chunk_0001.bin", np.arange(5000) % 1000)
    bad = tmp_path / "chunk_0002.bin"
    tokens = np.arange(50_000) % 1000
    if case == "odd":
        bad.write_bytes(tokens.astype("<u2").tobytes() + b"\0")
    elif case == "short":
        write_tokens(bad, tokens[:64])
    elif case == "id_small_file":  # small files are read whole: one bad token anywhere is found
        tokens = tokens[:3000].copy()
        tokens[1234] = 1000
        write_tokens(bad, tokens)
    else:  # large files are sampled, but the head and tail always are
        tokens = tokens.copy()
        tokens[3 if case == "id_at_start" else -3] = 40_000
        write_tokens(bad, tokens)
    with pytest.raises(ValueError, match=match) as error:
        check_token_files([good, bad], vocab_size=1000, seq_len=127, sample_tokens=4096)
    assert "chunk_0002.bin" in str(error.value)


def test_summary_and_bos_detection(tmp_path):
    with_bos = write_synthetic(tmp_path / "synth", 300_000, chunk_tokens=100_000, n_states=200, doc_len=100)
    summary = check_token_files(with_bos, vocab_size=32000, seq_len=255, sample_tokens=10_000)
    assert summary["files"] == 3 and summary["tokens"] == 300_000
    assert summary["has_bos"] and summary["min_id"] == 1 and summary["max_id"] < 32000
    assert summary["bos_rate"] == pytest.approx(0.01 / 1.01, rel=0.3)

    plain = tmp_path / "plain"
    plain.mkdir()
    position_files(plain, [20_000])
    assert not check_token_files(find_token_files(plain), 32000, 255)["has_bos"]
    frequent = write_tokens(tmp_path / "frequent.bin", np.arange(20_000) % 8)  # id 1 every 8 tokens: not BOS
    assert not check_token_files([frequent], 32000, 255)["has_bos"]


# --- train / validation split ---------------------------------------------------------------------------------

def test_validation_is_the_tail_of_the_last_file_and_never_trained_on(tmp_path):
    arrays = position_files(tmp_path, [6000, 5000, 4000])
    data = load_token_data(tmp_path, vocab_size=32000, seq_len=63, val_tokens=1500)
    assert np.array_equal(data.val, arrays[-1][-1500:])
    assert [len(a) for a in data.train] == [6000, 5000, 2500]
    assert np.intersect1d(np.concatenate(data.train), data.val).size == 0
    assert data.bos_id is None and "last 1,500 tokens of chunk_0003.bin" in data.source
    with BatchLoader(data.train, 63, 4, 0, 1, block_windows=4) as loader:
        assert np.intersect1d(epoch0_windows(loader), data.val).size == 0

    with pytest.raises(ValueError, match="chunk_0003.bin .*--val_tokens"):
        load_token_data(tmp_path, 32000, 63, val_tokens=4000)


def test_explicit_val_file_leaves_all_chunks_for_training(tmp_path):
    position_files(tmp_path, [3000, 3000])
    val = write_tokens(tmp_path / "val.bin", np.arange(60_000, 62_000))
    data = load_token_data(tmp_path, 65536, 63, val_tokens=1000, val_file=val)
    assert [len(a) for a in data.train] == [3000, 3000]
    assert np.array_equal(data.val, np.arange(60_000, 61_000))
    with pytest.raises(FileNotFoundError, match="--val_file"):
        load_token_data(tmp_path, 65536, 63, val_tokens=1000, val_file=tmp_path / "missing.bin")


def test_synthetic_default_data_is_deterministic():
    first = load_token_data(None, 32000, 255, val_tokens=10_000)
    second = load_token_data(None, 32000, 255, val_tokens=10_000)
    assert np.array_equal(first.train[0], second.train[0]) and np.array_equal(first.val, second.val)
    assert len(first.val) == 10_000 and first.bos_id == data.BOS_ID and first.train[0][0] == data.BOS_ID
    assert first.summary["entropy_floor_nats"] == synthetic_entropy_nats()


# --- BatchLoader ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_read_disjoint_windows_once_per_epoch(tmp_path, world_size):
    window, block_windows = 16, 4  # whole blocks only, so every epoch-0 window can be counted
    blocks = [50, 37, 20]
    arrays = position_files(tmp_path, [n * block_windows * window for n in blocks])
    per_rank = sum(blocks) // world_size
    seen = []
    for rank in range(world_size):
        with BatchLoader(arrays, window - 1, block_windows, rank, world_size, seed=7,
                         block_windows=block_windows) as loader:
            windows = epoch0_windows(loader)
        assert len(windows) == per_rank * block_windows
        assert np.all(np.diff(windows, axis=1) == 1)  # each window is one contiguous stretch of a file
        seen.append(windows)
    tokens = np.concatenate(seen).ravel()
    assert len(np.unique(tokens)) == len(tokens)  # no token in two windows, across all ranks
    assert np.all((np.concatenate(seen)[:, 0] - 2) % window == 0)  # on the window grid of each file


def test_loader_is_deterministic_shuffled_and_wraps(tmp_path):
    arrays = position_files(tmp_path, [8000, 8000])

    def first_batches(seed, n=12):
        with BatchLoader(arrays, 31, 8, 1, 2, seed=seed, block_windows=4) as loader:
            batches = [full_windows(*next(loader)) for _ in range(n)]
            return np.stack(batches), loader.epoch

    same, _ = first_batches(0)
    assert np.array_equal(same, first_batches(0)[0])
    assert not np.array_equal(same, first_batches(1)[0])
    assert not np.all(np.diff(same[:, :, 0].ravel()) > 0)  # not in file order

    with BatchLoader(arrays, 31, 8, 0, 1, block_windows=4) as loader:
        epoch0 = epoch0_windows(loader)
        assert loader.epoch == 1  # ran past the data: a new epoch, not StopIteration
        epoch1 = np.concatenate([full_windows(*next(loader)) for _ in range(len(epoch0) // 8 - 1)])
    assert not np.array_equal(epoch0[:len(epoch1)], epoch1)  # reshuffled


def test_loader_reads_memmaps_at_their_offset(tmp_path):
    position_files(tmp_path, [12_000])  # token at position p is p + 2
    path = tmp_path / "chunk_0001.bin"
    mapped = np.memmap(path, dtype="<u2", mode="r", offset=2 * 1000, shape=(8000,))  # read with pread
    sliced = np.memmap(path, dtype="<u2", mode="r")[3000:11_000]  # a view: read by slicing
    for array, first in ((mapped, 1002), (sliced, 3002)):
        with BatchLoader([array], 31, 4, 0, 1, block_windows=4) as loader:
            windows = epoch0_windows(loader)
        assert windows.min() == first and windows.max() < first + 8000
        assert np.all(np.diff(windows, axis=1) == 1) and np.all((windows[:, 0] - first) % 32 == 0)


def test_loader_prefetches_in_the_background(tmp_path):
    arrays = position_files(tmp_path, [20_000])
    with BatchLoader(arrays, 63, 4, 0, 1, prefetch=3) as loader:
        deadline = time.monotonic() + 10
        while loader._queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader._queue.qsize() == 3  # ready before anyone asked
        x, y = next(loader)
        assert x.shape == y.shape == (4, 63) and x.device.type == "cpu"
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_doc_window_starts_is_the_greedy_chain():
    rng = np.random.default_rng(0)
    for _ in range(200):
        limit, window = int(rng.integers(1, 400)), int(rng.integers(1, 40))
        bos = np.flatnonzero(rng.random(limit) < rng.uniform(0.01, 0.5))
        expected, end = [], 0
        for b in bos:  # reference: one Python step per window
            if b >= end and b + window <= limit:
                expected.append(b)
                end = b + window
        assert _doc_window_starts(bos, window, limit).tolist() == expected


@pytest.mark.parametrize("world_size", [1, 2])
def test_doc_aligned_windows_start_at_bos(tmp_path, world_size):
    rng = np.random.default_rng(1)
    n = 30_000
    tokens = np.arange(2, n + 2)  # distinct ids, except the BOS that overwrite document starts
    starts = np.cumsum(rng.integers(5, 60, n // 5))
    tokens[starts[starts < n]] = data.BOS_ID
    tokens[0] = data.BOS_ID
    write_tokens(tmp_path / "chunk_0001.bin", tokens)
    arrays = [np.memmap(tmp_path / "chunk_0001.bin", dtype="<u2", mode="r")]
    seen = []
    for rank in range(world_size):
        with BatchLoader(arrays, 31, 8, rank, world_size, doc_aligned=True, bos_id=data.BOS_ID,
                         block_windows=8) as loader:
            windows = epoch0_windows(loader)
        assert np.all(windows[:, 0] == data.BOS_ID)
        positions = np.where(windows == data.BOS_ID, -1, windows - 2)
        ids = windows[:, 1:2] - 3 + np.arange(32)  # position of each slot, from the token after the BOS
        assert np.all((positions == -1) | (positions == ids))  # contiguous stretches of the file
        seen.append(positions[positions >= 0])
    positions = np.concatenate(seen)
    assert len(np.unique(positions)) == len(positions)
    assert len(positions) > 0.4 * n  # most tokens are used: only the gaps from a window end to the next BOS go

    with pytest.raises(ValueError, match="BOS"):
        BatchLoader(arrays, 31, 8, 0, 1, doc_aligned=True, bos_id=None)


def test_too_few_blocks_for_the_ranks(tmp_path):
    arrays = position_files(tmp_path, [200])
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        BatchLoader(arrays, 31, 2, 0, 4)


# --- validation batches ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_val_batches_equal_counts_disjoint_and_fixed(world_size):
    val = np.arange(2, 2 + 13 * 64 + 17).astype(np.uint16)  # 13 windows of 64 and a ragged remainder
    per_rank = [val_batches(val, 63, 2, rank, world_size) for rank in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1  # same number of forward passes on every rank
    assert len({tuple(x.shape for x, _ in b) for b in per_rank}) == 1
    windows = np.concatenate([full_windows(x, y) for batches in per_rank for x, y in batches])
    assert len(windows) == 13 // world_size * world_size
    assert len(np.unique(windows)) == windows.size
    again = val_batches(val, 63, 2, world_size - 1, world_size)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, per_rank[-1]))
    assert len(val_batches(val, 63, 2, 0, 1, max_tokens=3 * 64)) == 2  # 3 windows in batches of 2
    with pytest.raises(ValueError, match="--val_tokens"):
        val_batches(val[:100], 63, 2, 0, 2)


# --- synthetic data -------------------------------------------------------------------------------------------

def conditional_entropy_nats(tokens):
    """Plug-in estimate of H(next token | current token)."""
    ids, states = np.unique(tokens, return_inverse=True)
    pairs = np.bincount(states[:-1] * len(ids) + states[1:], minlength=len(ids) ** 2).reshape(len(ids), -1)
    rows = pairs.sum(axis=1, keepdims=True)
    p = np.where(pairs > 0, pairs / np.maximum(rows, 1), 1.0)
    return float(-(pairs * np.log(p)).sum() / pairs.sum())


@pytest.mark.parametrize("n_successors, doc_len", [(8, 256), (3, 40)])
def test_synthetic_entropy_matches_stated_rate(n_successors, doc_len):
    tokens = synthetic_tokens(1 << 20, n_states=256, n_successors=n_successors, doc_len=doc_len, seed=3)
    assert tokens.dtype == np.uint16 and len(tokens) == 1 << 20 and tokens[0] == data.BOS_ID
    rate = synthetic_entropy_nats(n_successors, doc_len)
    assert conditional_entropy_nats(tokens) == pytest.approx(rate, abs=0.01)
    p_bos = 1 / doc_len
    assert np.mean(tokens == data.BOS_ID) == pytest.approx(p_bos / (1 + p_bos), rel=0.05)
    assert len(np.unique(tokens)) <= 256
    assert not np.any((tokens[1:] == data.BOS_ID) & (tokens[:-1] == data.BOS_ID))  # no empty documents


def test_synthetic_is_deterministic_and_parts_differ(tmp_path):
    a = synthetic_tokens(50_000, vocab_size=1000, n_states=100)
    assert np.array_equal(a, synthetic_tokens(50_000, vocab_size=1000, n_states=100))
    other_part = synthetic_tokens(50_000, vocab_size=1000, n_states=100, part=1)
    assert not np.array_equal(a, other_part)
    assert set(np.unique(other_part)) <= set(np.unique(a))  # same chain, another stretch of it
    assert a.max() < 1000
    with pytest.raises(ValueError, match="n_states"):
        synthetic_tokens(1000, vocab_size=50, n_states=100)


# --- CLI ------------------------------------------------------------------------------------------------------

def test_cli_synth_check_bench(tmp_path, capsys):
    data.data_cli(["synth", str(tmp_path), "--tokens", "2e5", "--chunk_tokens", "1e5", "--n_states", "300"])
    assert [p.name for p in find_token_files(tmp_path)] == ["chunk_0001.bin", "chunk_0002.bin"]
    data.data_cli(["check", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ok: 2 files, 200,000 tokens" in out and ": detected" in out
    data.data_cli(["bench", str(tmp_path), "--seq_len", "63", "--batch_size", "4", "--batches", "5",
                   "--matmul", "32"])
    out = capsys.readouterr().out
    assert "tokens/s" in out and "with loader" in out
    with pytest.raises(SystemExit, match="error: .*odd size"):
        (tmp_path / "chunk_0003.bin").write_bytes(b"\0" * 3001)
        data.data_cli(["check", str(tmp_path)])

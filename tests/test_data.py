"""Tests for data.py and the loader's parts (shards.py, windows.py, prefetch.py), synthetic.py and data_cli.py: file
checks, the deal, rank-disjoint shuffled batches, validation split, synthetic entropy, the CLI (its bad counts and
targets one sentence and exit 2, a full disk leaving no partial chunk)."""

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
import data_cli
from data import BatchLoader, check_token_files, find_token_files, load_token_data, val_batches
from shards import Deal, Shards, deal_blocks, staged_blocks
from synthetic import synthetic_entropy_nats, synthetic_tokens, write_synthetic
from windows import BOS_ID, WindowReader, WindowSpec, doc_window_starts, token_layout
from conftest import epoch0_windows, full_windows, tmpfs

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


# --- file checks -------------------------------------------------------------------------------------------


def test_missing_folder_and_no_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_token_files(tmp_path / "nope")
    write_tokens(tmp_path / "val.bin", np.arange(100))  # not a chunk file
    with pytest.raises(FileNotFoundError, match=r"no chunk_\*\.bin"):
        find_token_files(tmp_path)


@pytest.mark.parametrize("case", ["broken_symlink", "folder"])
def test_a_chunk_name_that_is_not_a_file_is_an_error(tmp_path, case):
    write_tokens(tmp_path / "chunk_0001.bin", np.arange(100))
    odd_one = tmp_path / "chunk_0002.bin"
    if case == "folder":
        odd_one.mkdir()
    else:
        odd_one.symlink_to(tmp_path / "staged" / "chunk_0002.bin")
    error = FileNotFoundError if case == "broken_symlink" else ValueError
    with pytest.raises(
        error, match="chunk_0002.bin is " + ("a broken symlink" if error is FileNotFoundError else "a folder")
    ):
        find_token_files(tmp_path)


def test_files_sorted_by_name(tmp_path):
    for i in (3, 1, 2):
        write_tokens(tmp_path / f"chunk_{i:04d}.bin", np.arange(10))
    assert [p.name for p in find_token_files(tmp_path)] == ["chunk_0001.bin", "chunk_0002.bin", "chunk_0003.bin"]


@pytest.mark.parametrize(
    "case, match",
    [
        ("odd", "odd size"),
        ("short", "fewer than one window"),
        ("id_at_start", ">= --vocab_size 1000"),
        ("id_at_end", ">= --vocab_size 1000"),
        ("id_small_file", ">= --vocab_size 1000"),
    ],
)
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


def sparse_bad_file(folder, n_tokens=1 << 21, n_bad=10, bad_id=40_000):
    """A file of n_tokens good ids with n_bad ids of bad_id scattered through it."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 32000, n_tokens).astype("<u2")
    positions = np.sort(rng.choice(n_tokens, n_bad, replace=False))
    tokens[positions] = bad_id
    write_tokens(folder / "chunk_0001.bin", tokens)
    return positions


def test_sparse_bad_ids_pass_the_sample_and_fail_the_full_scan(tmp_path, capsys):
    positions = sparse_bad_file(tmp_path)
    files = find_token_files(tmp_path)
    assert check_token_files(files, 32000, 127, sample_tokens=1 << 14)["max_id"] < 32000  # the sample misses them
    message = re.escape(
        f"chunk_0001.bin holds 10 token ids >= --vocab_size 32000, the first (40000) at token {positions[0]:,}."
    )
    with pytest.raises(ValueError, match=message):
        check_token_files(files, 32000, 127, full=True)
    with pytest.raises(SystemExit) as exit_info:
        data_cli.main(["check", str(tmp_path), "--full", "--seq_len", "127"])
    assert exit_info.value.code == 2 and re.search(message, capsys.readouterr().err)
    chunks = data._file_chunks(files[0], token_layout(files[0]), chunk_tokens=1000)
    stats = data._id_stats(chunks, 32000, BOS_ID)  # positions across reads
    assert stats["bad"] == 10 and stats["first_bad"] == (40000, positions[0]) and stats["seen"] == 1 << 21


def recorded_reads(monkeypatch):
    """The start of every range a WindowReader reads from now on, in order."""
    starts, read = [], WindowReader.read

    def recording_read(self, index, start, end):
        starts.append(start)
        return read(self, index, start, end)

    monkeypatch.setattr(WindowReader, "read", recording_read)
    return starts


def test_loader_drops_and_counts_windows_with_bad_ids_and_warns_once(tmp_path, capfd, monkeypatch):
    positions = sparse_bad_file(tmp_path)
    window, block = 128, 64 * 128
    arrays = [np.memmap(tmp_path / "chunk_0001.bin", dtype="<u2", mode="r")]
    all_windows = np.asarray(arrays[0]).reshape(-1, window)
    bad_windows = set((positions // window).tolist())
    good = np.delete(all_windows, sorted(bad_windows), axis=0)
    read_starts = recorded_reads(monkeypatch)
    with BatchLoader(arrays, WindowSpec(window - 1, vocab_size=32000), 64, Deal(0, 1, block_windows=64)) as loader:
        served = []
        while loader.epoch == 0:  # through the batch that completes epoch 0 with epoch 1's first windows
            served.append(full_windows(*next(loader)))
    served = np.concatenate(served)
    assert served.max() < 32000
    epoch0 = np.unique(served[: len(good)], axis=0)
    assert len(epoch0) == len(good) and np.array_equal(epoch0, np.unique(good, axis=0))  # every good window, once
    read_bad = [w for start in read_starts for w in bad_windows if start <= w * window < start + block]
    assert loader.bad_windows == len(read_bad) >= len(bad_windows)  # the reading thread runs ahead into epoch 1
    warnings = capfd.readouterr().err.strip().splitlines()
    assert len(warnings) == 1, warnings
    first = next(p for start in read_starts for p in positions if start <= p < start + block)
    assert warnings[0] == (
        f"warning: rank 0: {arrays[0].filename} at token {first:,} holds id 40000 >= vocab_size "
        f"32000; every window holding such an id is skipped and counted (said once)."
    )


def test_bad_id_in_the_validation_tokens_is_an_error(tmp_path, monkeypatch):
    tokens = np.arange(20_000) % 1000
    tokens[-10] = 5000  # in the held-out tail
    write_tokens(tmp_path / "chunk_0001.bin", tokens)
    monkeypatch.setattr(data, "_sample_file", lambda path, *args: np.fromfile(path, dtype="<u2", count=1000))
    with pytest.raises(ValueError, match="validation tokens .* hold ids >= --vocab_size 1000 .*token 990"):
        load_token_data(tmp_path, 1000, 63, val_tokens=1000)


# --- train / validation split ---------------------------------------------------------------------------------


def test_validation_is_the_tail_of_the_last_file_and_never_trained_on(tmp_path):
    arrays = position_files(tmp_path, [6000, 5000, 4000])
    data = load_token_data(tmp_path, vocab_size=32000, seq_len=63, val_tokens=1500)
    assert np.array_equal(data.val, arrays[-1][-1500:])
    assert [len(a) for a in data.train] == [6000, 5000, 2500]
    assert np.intersect1d(np.concatenate(data.train), data.val).size == 0
    assert data.bos_id is None and "last 1,500 tokens of chunk_0003.bin" in data.source
    with BatchLoader(data.train, WindowSpec(63), 4, Deal(0, 1, block_windows=4)) as loader:
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
    assert len(first.val) == 10_000 and first.bos_id == BOS_ID and first.train[0][0] == BOS_ID
    assert first.summary["entropy_floor_nats"] == synthetic_entropy_nats()


# --- the deal (shards.py) -------------------------------------------------------------------------------------


def hands(lengths, world_size, seed, epoch):
    """Each rank's (array index, start, end) blocks of 4 windows of 16 tokens in epoch, each from its own Shards."""
    deals = [Deal(rank, world_size, seed, block_windows=4) for rank in range(world_size)]
    return [list(Shards(lengths, 15, deal).ranges(epoch)) for deal in deals]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_deal_gives_ranks_disjoint_blocks_each_once_per_epoch_the_same_on_every_call(world_size):
    lengths = [50 * 64, 37 * 64 + 20, 7]  # 50 whole blocks; 37 and a short one; a file too short for any window
    per_epoch = []
    for epoch in range(3):
        dealt = hands(lengths, world_size, 7, epoch)
        assert dealt == hands(lengths, world_size, 7, epoch)  # the same on every call: no rank asks another
        assert len({len(hand) for hand in dealt}) == 1  # the same count for every rank, the remainder dropped
        blocks = [block for hand in dealt for block in hand]
        assert len(blocks) == len(set(blocks)) == 88 // world_size * world_size  # disjoint, each block once
        assert {index for index, _, _ in blocks} <= {0, 1} and {end - start for _, start, end in blocks} <= {64, 20}
        for file in (0, 1):  # and disjoint token ranges, not just distinct ones
            spans = sorted((start, end) for index, start, end in blocks if index == file)
            assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        # round-robin from one order: the ranks' k-th blocks are the k-th world_size blocks of the 1-rank deal (so
        # 2 ranks with batch b see the windows of 1 rank with batch 2b: the premise of test_train's DDP comparisons)
        interleaved = [hand[k] for k in range(len(dealt[0])) for hand in dealt]
        assert interleaved == hands(lengths, 1, 7, epoch)[0][: len(blocks)]
        per_epoch.append(blocks)
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]  # reshuffled every epoch
    assert [block for hand in hands(lengths, world_size, 8, 0) for block in hand] != per_epoch[0]  # by the seed


def test_staged_blocks_are_the_start_of_the_ranks_deal_over_epochs():
    for count in (1, 10, 25, 60):  # 22 blocks a rank an epoch: 60 runs into a third epoch
        dealt = np.concatenate([deal_blocks(89, 3, 4, 5, epoch) for epoch in range(3)])
        assert np.array_equal(staged_blocks(89, 3, 4, 5, count), dealt[:count])


# --- BatchLoader ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_read_disjoint_windows_once_per_epoch(tmp_path, world_size):
    window, block_windows = 16, 4  # whole blocks only, so every epoch-0 window can be counted
    blocks = [50, 37, 20]
    arrays = position_files(tmp_path, [n * block_windows * window for n in blocks])
    per_rank = sum(blocks) // world_size
    seen = []
    for rank in range(world_size):
        deal = Deal(rank, world_size, seed=7, block_windows=block_windows)
        with BatchLoader(arrays, WindowSpec(window - 1), block_windows, deal) as loader:
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
        with BatchLoader(arrays, WindowSpec(31), 8, Deal(1, 2, seed=seed, block_windows=4)) as loader:
            batches = [full_windows(*next(loader)) for _ in range(n)]
            return np.stack(batches), loader.epoch

    same, _ = first_batches(0)
    assert np.array_equal(same, first_batches(0)[0])
    assert not np.array_equal(same, first_batches(1)[0])
    assert not np.all(np.diff(same[:, :, 0].ravel()) > 0)  # not in file order

    with BatchLoader(arrays, WindowSpec(31), 8, Deal(0, 1, block_windows=4)) as loader:
        epoch0 = epoch0_windows(loader)
        assert loader.epoch == 1  # ran past the data: a new epoch, not StopIteration
        epoch1 = np.concatenate([full_windows(*next(loader)) for _ in range(len(epoch0) // 8 - 1)])
    assert not np.array_equal(epoch0[: len(epoch1)], epoch1)  # reshuffled


def test_loader_reads_memmaps_at_their_offset(tmp_path):
    position_files(tmp_path, [12_000])  # token at position p is p + 2
    path = tmp_path / "chunk_0001.bin"
    mapped = np.memmap(path, dtype="<u2", mode="r", offset=2 * 1000, shape=(8000,))  # read with pread
    sliced = np.memmap(path, dtype="<u2", mode="r")[3000:11_000]  # a view: read by slicing
    for array, first in ((mapped, 1002), (sliced, 3002)):
        with BatchLoader([array], WindowSpec(31), 4, Deal(0, 1, block_windows=4)) as loader:
            windows = epoch0_windows(loader)
        assert windows.min() == first and windows.max() < first + 8000
        assert np.all(np.diff(windows, axis=1) == 1) and np.all((windows[:, 0] - first) % 32 == 0)


def test_prefetch_serves_its_depth_through_a_stalled_read(tmp_path, monkeypatch):
    # the reading thread fills `depth` batches ahead, nobody asking; then the next read stalls for a second: the
    # queued batches are served at once, and only a batch behind the stalled read waits (one read per batch)
    arrays = position_files(tmp_path, [100_000])
    stall, stalling, stalled = 1.0, [], []
    read = WindowReader.read

    def slow_read(self, *args):
        if stalling and not stalled:
            stalled.append(True)
            time.sleep(stall)
        return read(self, *args)

    monkeypatch.setattr(WindowReader, "read", slow_read)
    with BatchLoader(arrays, WindowSpec(31), 4, Deal(0, 1, block_windows=4), prefetch_tokens=25 * 4 * 31) as loader:
        assert loader.depth == 25
        time.sleep(1.0)  # the queue fills in the background
        stalling.append(True)
        waits = []
        while not waits or waits[-1] < stall / 2 and len(waits) < 3 * loader.depth:
            asked = time.perf_counter()
            x, y = next(loader)
            waits.append(time.perf_counter() - asked)
        assert x.shape == y.shape == (4, 31) and x.device.type == "cpu"
    assert stalled and waits[-1] >= stall / 2  # the read did stall, and a batch behind it waited
    assert len(waits) - 1 >= loader.depth and sum(waits[: loader.depth]) < stall / 4  # served without waiting
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)


def test_served_batches_are_the_callers_own(tmp_path):
    arrays = position_files(tmp_path, [50_000])
    with BatchLoader(arrays, WindowSpec(15), 4, Deal(0, 1, block_windows=4)) as loader:
        served = [(x, x.clone()) for x, _ in (next(loader) for _ in range(5 * (loader.depth + 2)))]
    assert all(torch.equal(x, at_serving) for x, at_serving in served)  # no ring slot reused under the caller
    assert len({x[0, 0].item() for x, _ in served}) == len(served)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_survive_a_lagging_stream(tmp_path):
    """Pinned ring slots are refilled only after their host-to-device copy ran: the stream is kept busy so the
    copies run long after next() returned, while the reading thread races ahead through the ring."""
    arrays = position_files(tmp_path, [200_000])
    deal = Deal(0, 1, block_windows=8)
    with BatchLoader(arrays, WindowSpec(63), 8, deal) as on_cpu:
        expected = [next(on_cpu)[0] for _ in range(40)]
    busy = torch.randn(2048, 2048, device="cuda")
    with BatchLoader(arrays, WindowSpec(63), 8, deal, device="cuda", prefetch_tokens=2 * 8 * 63) as on_gpu:
        assert on_gpu._ring.is_pinned() and len(on_gpu._ring) == on_gpu.depth + 2 == 4
        served = []
        for _ in range(40):
            for _ in range(5):  # ~ms of queued work ahead of each copy
                busy = (busy @ busy).tanh_()
            served.append(next(on_gpu)[0])
        torch.cuda.synchronize()
    assert all(torch.equal(x.cpu(), want) for x, want in zip(served, expected))


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
        assert doc_window_starts(bos, window, limit).tolist() == expected


@pytest.mark.parametrize("world_size", [1, 2])
def test_doc_aligned_windows_start_at_bos(tmp_path, world_size):
    rng = np.random.default_rng(1)
    n = 30_000
    tokens = np.arange(2, n + 2)  # distinct ids, except the BOS that overwrite document starts
    starts = np.cumsum(rng.integers(5, 60, n // 5))
    tokens[starts[starts < n]] = BOS_ID
    tokens[0] = BOS_ID
    write_tokens(tmp_path / "chunk_0001.bin", tokens)
    arrays = [np.memmap(tmp_path / "chunk_0001.bin", dtype="<u2", mode="r")]
    seen = []
    for rank in range(world_size):
        spec = WindowSpec(31, doc_aligned=True, bos_id=BOS_ID)
        with BatchLoader(arrays, spec, 8, Deal(rank, world_size, block_windows=8)) as loader:
            windows = epoch0_windows(loader)
        assert np.all(windows[:, 0] == BOS_ID)
        positions = np.where(windows == BOS_ID, -1, windows - 2)
        ids = windows[:, 1:2] - 3 + np.arange(32)  # position of each slot, from the token after the BOS
        assert np.all((positions == -1) | (positions == ids))  # contiguous stretches of the file
        seen.append(positions[positions >= 0])
    positions = np.concatenate(seen)
    assert len(np.unique(positions)) == len(positions)
    assert len(positions) > 0.4 * n  # most tokens are used: only the gaps from a window end to the next BOS go

    with pytest.raises(ValueError, match="BOS"):
        WindowSpec(31, doc_aligned=True, bos_id=None)


def test_too_few_blocks_for_the_ranks_or_a_rank_outside_the_world(tmp_path):
    arrays = position_files(tmp_path, [200])
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        BatchLoader(arrays, WindowSpec(31), 2, Deal(0, 4))
    with pytest.raises(ValueError, match="rank 4 is outside world_size 4"):
        Deal(4, 4)


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
    assert tokens.dtype == np.uint16 and len(tokens) == 1 << 20 and tokens[0] == BOS_ID
    rate = synthetic_entropy_nats(n_successors, doc_len)
    assert conditional_entropy_nats(tokens) == pytest.approx(rate, abs=0.01)
    p_bos = 1 / doc_len
    assert np.mean(tokens == BOS_ID) == pytest.approx(p_bos / (1 + p_bos), rel=0.05)
    assert len(np.unique(tokens)) <= 256
    assert not np.any((tokens[1:] == BOS_ID) & (tokens[:-1] == BOS_ID))  # no empty documents


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


@pytest.mark.slow
def test_cli_synth_check_bench(tmp_path, capsys):
    data_cli.main(["synth", str(tmp_path), "--tokens", "2e5", "--chunk_tokens", "1e5", "--n_states", "300"])
    assert [p.name for p in find_token_files(tmp_path)] == ["chunk_0001.bin", "chunk_0002.bin"]
    data_cli.main(["check", str(tmp_path)])
    out = capsys.readouterr().out
    assert "ok: 2 files (raw uint16), 200,000 tokens" in out and ": detected" in out
    data_cli.main(["bench", str(tmp_path), "--seq_len", "63", "--batch_size", "4", "--batches", "5", "--matmul", "32"])
    out = capsys.readouterr().out
    assert "tokens/s" in out and "with loader" in out
    # the documented entry, `python data_cli.py ...`; `python data.py ...` (the library) says where the CLI is
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, repo / "data_cli.py", "check", tmp_path],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "ok: 2 files (raw uint16), 200,000 tokens" in done.stdout, done.stderr[-2000:]
    done = subprocess.run(
        [sys.executable, repo / "data.py", "check", tmp_path], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "python data_cli.py check" in done.stderr and not done.stdout, done.stderr
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        (tmp_path / "chunk_0003.bin").write_bytes(b"\0" * 3001)
        data_cli.main(["check", str(tmp_path)])
    assert exit_info.value.code == 2 and re.search("error: .*odd size", capsys.readouterr().err)


def data_cli_run(argv, capsys):
    import data_cli

    try:
        data_cli.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


DATA_CLI_CASES = {
    "tokens 0": (["synth", "OUT", "--tokens", "0"], "--tokens: '0' is not a whole number"),
    "tokens nan": (["synth", "OUT", "--tokens", "nan"], "--tokens: 'nan' is not a whole number"),
    "tokens inf": (["synth", "OUT", "--tokens", "inf"], "--tokens: 'inf' is not a whole number"),
    "tokens 1.5": (["synth", "OUT", "--tokens", "1.5"], "--tokens: '1.5' is not a whole number"),
    "chunk_tokens 0": (["synth", "OUT", "--tokens", "1e4", "--chunk_tokens", "0"], "--chunk_tokens"),
    "doc_len 0": (["synth", "OUT", "--tokens", "1e4", "--doc_len", "0"], "--doc_len"),
    "n_states above vocab": (["synth", "OUT", "--tokens", "1e4", "--vocab_size", "100"], "n_states <= vocab_size"),
    "vocab 1e9": (["synth", "OUT", "--tokens", "1e4", "--vocab_size", "1e9"], "at most 65536"),
    "seed -1": (["synth", "OUT", "--tokens", "1e4", "--seed", "-1"], "--seed"),
    "check seq_len 0": (["check", "DATA", "--seq_len", "0"], "--seq_len"),
    "check seq_len nan": (["check", "DATA", "--seq_len", "nan"], "--seq_len"),
    "bench batches 0": (["bench", "DATA", "--batches", "0"], "--batches"),
    "bench batch_size -1": (["bench", "DATA", "--batch_size", "-1"], "--batch_size"),
    "synth into a file": (["synth", "DATA/chunk_0001.bin", "--tokens", "1e4"], "is a file, not a folder"),
    "synth over existing chunks": (["synth", "DATA", "--tokens", "1e4"], "exists; synth never replaces token files"),
}


@pytest.mark.parametrize("case", DATA_CLI_CASES.values(), ids=DATA_CLI_CASES.keys())
def test_data_cli_bad_counts_and_targets_are_one_sentence_and_exit_2(tmp_path, token_copy, capsys, case):
    argv, words = case
    data = token_copy
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    argv = [a.replace("OUT", str(tmp_path / "out")).replace("DATA", str(data)) for a in argv]
    code, err = data_cli_run(argv, capsys)
    assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before and not (tmp_path / "out").exists()


def test_synth_on_a_full_disk_leaves_no_partial_chunk(tmp_path, capsys):
    with tmpfs(tmp_path / "disk", "256k") as disk:
        code, err = data_cli_run(["synth", disk / "out", "--tokens", "3e5", "--chunk_tokens", "5e4"], capsys)
        assert code == 2 and "No space left on device" in err and err.count("\n") == 1, err
        written = sorted(p.name for p in (disk / "out").iterdir())
        assert written and all(p.startswith("chunk_") for p in written)  # whole chunks only, no temporary file
        assert all((disk / "out" / p).stat().st_size == 100_000 for p in written)

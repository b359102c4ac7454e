"""Token data for the speedrun trainer: folders of chunk_*.bin files, raw little-endian uint16 ids, no header.
check_token_files catches bad data in seconds (it samples; `check --full` scans every token, off the clock);
load_token_data memmaps the files and holds out a validation range; BatchLoader builds rank-disjoint, block-shuffled
batches in a background thread and checks every token it reads (from a folder stage.py wrote, only the blocks staged
for its rank); synthetic_tokens is an embedded Markov source whose entropy rate (the best possible loss) is known
exactly.
CLI: python data.py check DIR [--full] | synth OUT_DIR --tokens N | bench DIR
"""

import argparse
import dataclasses
import itertools
import json
import mmap
import pathlib
import queue
import sys
import threading
import time
from contextlib import nullcontext

import numpy as np
import torch

BOS_ID = 1  # document start in Llama/Mistral-style 32K vocabularies
BOS_RATE_RANGE = (1e-5, 0.05)  # id 1 once per 20..100k tokens looks like document starts, not a common token
SYNTH_TRAIN_TOKENS = 1 << 23  # embedded default data: ~8M training tokens, generated in well under a second
SYNTH_STATES = 1024  # few enough that a tiny model on 2 CPU cores nears the floor in ~2 minutes
# Loader prefetch on CUDA, as a token budget. Event arithmetic: a B300 at ~40% of 2.25 PFLOP/s bf16 on a
# ~1.5 GFLOP/token model trains ~600K tokens/s, so a 1 s storage stall on one rank is ~600K tokens, and one
# stalled rank holds all 32 at the next all-reduce. 2M tokens (32 MiB of pinned int64 x and y) ride out ~3.5 s.
PREFETCH_TOKENS = 1 << 21
SAMPLE_TOKENS = 1 << 18  # per file, read by the start-up check
# Windows per loader block: 131 KB per read at seq_len 1024, ~9 reads/s per rank at the event's ~600K tokens/s, a
# load NFS serves easily; the prefetch, not the read size, is what rides out a slow read.
BLOCK_WINDOWS = 64
STAGED_MANIFEST = "staged.json"  # written by stage.py beside the token files it staged


class DataChanged(ValueError):
    """The training files changed under a running job until none is left to read."""


def find_token_files(data_dir):
    """The folder's chunk_*.bin files in name order (the event files are zero-padded). Anything by that name that
    is not a readable file is an error, not skipped: a silently missing chunk changes the data."""
    folder = pathlib.Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"--data_dir {folder} does not exist or is not a folder.")
    files = sorted(folder.glob("chunk_*.bin"))
    for path in files:
        if path.is_symlink() and not path.exists():
            raise FileNotFoundError(f"{path} is a broken symlink (to {path.readlink()}).")
        if not path.is_file():
            raise ValueError(f"{path} is {'a folder' if path.is_dir() else 'not a regular file'}, not a token file.")
    if not files:
        raise FileNotFoundError(f"--data_dir {folder} holds no chunk_*.bin token files.")
    return files


def sample_slices(sizes, sample_tokens=SAMPLE_TOKENS, n_slices=8):
    """Per file of sizes[i] tokens, the (start, end) token ranges the sampled check reads: its head, its tail (where
    truncated writes show) and random spots, the same on every run; the whole file when it is small. stage.py copies
    them, so a staged folder passes the same check as the full one."""
    rng = np.random.default_rng(0)
    ranges = []
    for n_tokens in sizes:
        if n_tokens <= sample_tokens:
            ranges.append([(0, n_tokens)])
            continue
        length = max(sample_tokens // n_slices, 1)
        offsets = [0, n_tokens - length, *rng.integers(0, n_tokens - length, n_slices - 2).tolist()]
        ranges.append([(offset, offset + length) for offset in offsets])
    return ranges


def _sample_file(path, ranges):
    with open(path, "rb") as file:
        slices = []
        for start, end in ranges:
            file.seek(2 * start)
            slices.append(np.frombuffer(file.read(2 * (end - start)), dtype="<u2"))
    return np.concatenate(slices)


def _file_chunks(path, chunk_tokens=1 << 24):
    """Every token of a file, in 32 MiB reads."""
    with open(path, "rb") as file:
        while len(chunk := np.fromfile(file, dtype="<u2", count=chunk_tokens)):
            yield chunk


def _id_stats(chunks, vocab_size):
    """Tokens seen, min and max id, BOS count, and the ids >= vocab_size: how many, the first one and its position
    (counted over the chunks in order)."""
    stats = {"seen": 0, "min": None, "max": 0, "bos": 0, "bad": 0, "first_bad": None}
    for chunk in chunks:
        low, high = int(chunk.min()), int(chunk.max())
        stats["min"] = low if stats["min"] is None else min(stats["min"], low)
        stats["max"] = max(stats["max"], high)
        stats["bos"] += int(np.count_nonzero(chunk == BOS_ID))
        if high >= vocab_size:
            bad = np.flatnonzero(chunk >= vocab_size)
            if stats["first_bad"] is None:
                stats["first_bad"] = (int(chunk[bad[0]]), stats["seen"] + int(bad[0]))
            stats["bad"] += len(bad)
        stats["seen"] += len(chunk)
    return stats


def _summarise(n_files, n_tokens, file_stats):
    seen = sum(stats["seen"] for stats in file_stats)
    bos_rate = sum(stats["bos"] for stats in file_stats) / seen
    return {
        "files": n_files,
        "tokens": n_tokens,
        "checked_tokens": seen,
        "min_id": min(stats["min"] for stats in file_stats),
        "max_id": max(stats["max"] for stats in file_stats),
        "bos_rate": bos_rate,
        "has_bos": bool(BOS_RATE_RANGE[0] <= bos_rate <= BOS_RATE_RANGE[1]),
    }


def check_token_files(files, vocab_size, seq_len, sample_tokens=SAMPLE_TOKENS, full=False):
    """Validate token files from their sizes and ~sample_tokens sampled tokens each (every token if full); return a
    summary. Sparse bad ids can pass the sample: BatchLoader checks every token it reads."""
    sizes = []
    for path in files:  # sizes first: cheap, so every file is checked before any is read
        n_bytes = pathlib.Path(path).stat().st_size
        if n_bytes % 2:
            raise ValueError(f"{path} has an odd size ({n_bytes} bytes), so it is not a file of uint16 tokens.")
        if n_bytes // 2 < seq_len + 1:
            raise ValueError(
                f"{path} holds {n_bytes // 2} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}."
            )
        sizes.append(n_bytes // 2)
    file_stats, problems = [], []
    for path, ranges in zip(files, sample_slices(sizes, sample_tokens)):
        chunks = _file_chunks(path) if full else [_sample_file(path, ranges)]
        stats = _id_stats(chunks, vocab_size)
        if stats["bad"] and full:
            top, at = stats["first_bad"]
            problems.append(
                f"{path} holds {stats['bad']:,} token ids >= --vocab_size {vocab_size}, the first "
                f"({top}) at token {at:,}"
            )
        elif stats["bad"]:
            problems.append(
                f"{path} contains token id {stats['max']} >= --vocab_size {vocab_size} (seen in a sample "
                f"of {stats['seen']} tokens)"
            )
        file_stats.append(stats)
    if problems:
        raise ValueError("; ".join(problems) + ".")
    return _summarise(len(files), sum(sizes), file_stats)


@dataclasses.dataclass
class TokenData:
    train: list  # 1-D uint16 arrays (np.memmap of the files)
    val: np.ndarray  # 1-D uint16, in memory, never part of train
    summary: dict
    bos_id: int | None  # BOS_ID when the data marks document starts with it
    source: str  # one line for the log


def load_token_data(data_dir, vocab_size, seq_len, val_tokens, val_file=None):
    """Checked training arrays and validation tokens from data_dir, or the synthetic set when data_dir is None.
    Validation is the last val_tokens of the last file (cut from its training view), or val_file if given."""
    if val_tokens < 0:
        raise ValueError(f"--val_tokens must be >= 0, got {val_tokens}.")
    if data_dir is None:
        return _synthetic_data(vocab_size, seq_len, val_tokens)
    files = find_token_files(data_dir)
    summary = check_token_files(files, vocab_size, seq_len)
    train = [np.memmap(path, dtype="<u2", mode="r") for path in files]
    if val_file is not None:
        if not pathlib.Path(val_file).is_file():
            raise FileNotFoundError(f"--val_file {val_file} does not exist.")
        check_token_files([pathlib.Path(val_file)], vocab_size, seq_len)
        val = np.fromfile(val_file, dtype="<u2", count=val_tokens)
        where = f"first {len(val):,} tokens of {val_file}"
    else:
        cut = len(train[-1]) - val_tokens
        if cut < seq_len + 1:
            raise ValueError(
                f"{files[-1]} holds {len(train[-1])} tokens, too few for --val_tokens {val_tokens} plus "
                f"one training window; lower --val_tokens or pass --val_file."
            )
        train[-1] = np.memmap(files[-1], dtype="<u2", mode="r", shape=(cut,))  # a new map, not a slice (_is_file_map)
        val = np.fromfile(files[-1], dtype="<u2", count=val_tokens, offset=2 * cut)
        where = f"last {val_tokens:,} tokens of {files[-1].name}"
    if len(val) and (top := int(val.max())) >= vocab_size:  # in memory already: every validation token is checked
        at = int(np.argmax(val >= vocab_size))
        raise ValueError(
            f"the validation tokens ({where}) hold ids >= --vocab_size {vocab_size} (up to {top}), the "
            f"first at validation token {at:,}."
        )
    bos_id = BOS_ID if summary["has_bos"] else None
    source = (
        f"{len(files)} files in {data_dir}, {sum(map(len, train)):,} training tokens, validation = {where}, "
        f"BOS {f'id {BOS_ID}' if bos_id else 'not detected'} (rate {summary['bos_rate']:.1e})"
    )
    return TokenData(train, val, summary, bos_id, source)


def _synthetic_data(vocab_size, seq_len, val_tokens):
    n_states = min(SYNTH_STATES, vocab_size - 2)  # so any --vocab_size above ~10 still runs
    tokens = synthetic_tokens(SYNTH_TRAIN_TOKENS + val_tokens, vocab_size, n_states=n_states)
    floor = synthetic_entropy_nats()
    summary = {**_summarise(1, len(tokens), [_id_stats([tokens], vocab_size)]), "entropy_floor_nats": floor}
    source = (
        f"synthetic Markov chain ({n_states} states), {SYNTH_TRAIN_TOKENS:,} training + {val_tokens:,} "
        f"validation tokens, best possible loss {floor:.4f} nats/token"
    )
    return TokenData([tokens[:SYNTH_TRAIN_TOKENS]], tokens[SYNTH_TRAIN_TOKENS:], summary, BOS_ID, source)


def _is_file_map(array):
    """True for an np.memmap made straight from a file, not sliced from one: only then do .filename and .offset
    say where its first token is."""
    return isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap)


def _doc_window_starts(bos, window, limit):
    """Greedy disjoint windows in [0, limit) that each start at a BOS: the first BOS, then the first BOS at or
    after the end of the previous window, and so on. The chain is followed by pointer doubling: log2(n) numpy
    steps instead of one Python step per window."""
    bos = bos[bos + window <= limit]
    if len(bos) == 0:
        return bos
    hop = np.append(np.searchsorted(bos, bos + window), len(bos))  # next start; the sentinel maps to itself
    n_windows = (bos[-1] - bos[0]) // window + 1  # disjoint windows all starting in [bos[0], bos[-1]]
    steps = np.arange(n_windows)
    node = np.zeros(n_windows, dtype=np.int64)  # node[i] = hop applied i times to the first BOS
    for bit in range(int(n_windows).bit_length()):
        jump = (steps >> bit) & 1 == 1
        node[jump] = hop[node[jump]]
        hop = hop[hop]
    return bos[node[node < len(bos)]]


def block_layout(lengths, seq_len, block_windows=BLOCK_WINDOWS):
    """(array index, start, end) of every loader block over arrays of these lengths: block_windows windows of
    seq_len + 1 tokens (fewer at an array's end), in the order the deal shuffles."""
    window, block = seq_len + 1, block_windows * (seq_len + 1)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = [np.arange(0, max(n - window + 1, 0), block, dtype=np.int64) for n in lengths]
    index = np.repeat(np.arange(len(lengths)), [len(s) for s in starts])
    start = np.concatenate(starts)
    return index, start, np.minimum(start + block, lengths[index])


def deal_blocks(n_blocks, rank, world_size, seed, epoch):
    """The blocks rank reads in epoch: all n_blocks shuffled with a generator seeded by (seed, epoch) and dealt
    round-robin, the remainder dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    per_rank = n_blocks // world_size
    return order[: per_rank * world_size].reshape(per_rank, world_size)[:, rank]


def staged_blocks(n_blocks, rank, world_size, seed, count):
    """The first count blocks dealt to rank, over as many epochs as that takes: what stage.py copies for it."""
    dealt, epochs = [], itertools.count()
    while sum(map(len, dealt)) < count:
        dealt.append(deal_blocks(n_blocks, rank, world_size, seed, next(epochs)))
    return np.concatenate(dealt)[:count]


class BatchLoader:
    """Endless (x, y) int64 batches of shape (batch_size, seq_len) for one rank, y = x shifted by one.

    The arrays are cut into blocks of block_windows windows of seq_len + 1 tokens (one contiguous read each).
    Every epoch the blocks are shuffled with a generator seeded by (seed, epoch) and dealt round-robin to the
    ranks, the remainder dropped: ranks never share a window and no window repeats within an epoch. When a
    rank's share is used up it starts the next epoch (a new shuffle) instead of stopping; .epoch tells which.
    Windows never straddle blocks. doc_aligned: each window starts at a bos_id token (greedy, disjoint; the
    tokens between a window's end and the next BOS are skipped), as in modded-nanogpt.
    vocab_size: every block read is checked (a max over its tokens, cheap next to the read); a window holding an id
    >= vocab_size is dropped and counted in .bad_windows (by the reading thread, so it runs ahead of the batches
    served by up to the prefetch), and the first bad id is named once on stderr. The start-up check samples, so
    sparse bad ids cost a few windows here instead of an IndexError mid-run.
    Staged data (file maps of a folder holding STAGED_MANIFEST, written by stage.py): the rest of each file was never
    copied and reads as zeros, so the rank reads only the blocks staged for it: epoch 0 is exactly the start of its
    usual deal; later epochs repeat those blocks reshuffled, with one warning. A manifest made for another run
    (shape, world, seed, ranks, file lengths) is a ValueError.
    A daemon thread keeps .depth batches ready: prefetch_tokens worth (default: PREFETCH_TOKENS on CUDA, where a
    storage stall on one rank holds every rank; 2 batches elsewhere), in a fixed ring of host buffers, pinned on
    CUDA and copied with non_blocking=True; each batch served is the caller's own tensor.
    """

    def __init__(
        self,
        arrays,
        seq_len,
        batch_size,
        rank,
        world_size,
        seed=0,
        device="cpu",
        doc_aligned=False,
        bos_id=None,
        vocab_size=None,
        prefetch_tokens=None,
        block_windows=BLOCK_WINDOWS,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}.")
        if doc_aligned and bos_id is None:
            raise ValueError("--doc_aligned needs BOS document markers, but none were detected in the data.")
        self.arrays, self.seq_len, self.batch_size = arrays, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.doc_aligned, self.bos_id, self.vocab_size, self.epoch = doc_aligned, bos_id, vocab_size, 0
        self.bad_windows, self._warned, self._damaged = 0, False, set()
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        if self._pin and self.device.index is None:  # name the GPU: the loader thread must bind to it too
            self.device = torch.device("cuda", torch.cuda.current_device())
        lengths = [len(array) for array in arrays]
        self._block_array, self._block_start, self._block_end = block_layout(lengths, seq_len, block_windows)
        if len(self._block_start) < world_size:
            raise ValueError(
                f"the training data holds {len(self._block_start)} blocks of up to {block_windows * (seq_len + 1)} "
                f"tokens, fewer than the {world_size} ranks."
            )
        self._staged = self._staged_blocks(lengths, block_windows)
        if prefetch_tokens is None:
            prefetch_tokens = PREFETCH_TOKENS if self._pin else 0
        self.depth = max(2, -(-prefetch_tokens // (batch_size * seq_len)))
        # the queue holds depth slots, the thread fills one more and the caller copies out of one: with depth + 2
        # slots a slot is refilled only after the caller took the next one, and on CUDA after its copy event
        slots = self.depth + 2
        with torch.cuda.device(self.device) if self._pin else nullcontext():  # one cudaHostAlloc, not one per batch
            self._ring = torch.empty(slots, 2, batch_size, seq_len, dtype=torch.int64, pin_memory=self._pin)
        self._copied = [torch.cuda.Event() for _ in range(slots)] if self._pin else None
        # file maps are read with one pread per block: far fewer round trips than page faults on NFS
        self._files = [open(array.filename, "rb") if _is_file_map(array) else None for array in arrays]
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"batch-loader-{rank}", daemon=True)
        self._thread.start()

    def _staged_blocks(self, lengths, block_windows):
        """This rank's staged blocks when the arrays map files of a staged folder, else None."""
        if not self.arrays or not _is_file_map(self.arrays[0]):
            return None
        path = pathlib.Path(self.arrays[0].filename).parent / STAGED_MANIFEST
        if not path.is_file():
            return None
        staged = json.loads(path.read_text())
        run = {
            "seq_len": self.seq_len,
            "block_windows": block_windows,
            "world_size": self.world_size,
            "seed": self.seed,
            "lengths": lengths,
        }
        if differ := [key for key, value in run.items() if staged[key] != value]:
            raise ValueError(
                f"{path} was staged for another run: its {', '.join(differ)} differ from this run's; stage again "
                f"with this run's flags and world size (--val_tokens sets the last file's length), or read the full "
                f"data folder."
            )
        if self.rank not in staged["ranks"]:
            raise ValueError(
                f"{path} holds the blocks of ranks {staged['ranks']}, but torchrun made this process rank "
                f"{self.rank} (stage.py orders the nodes by name, as torchrun's c10d rendezvous does); read the "
                f"full data folder."
            )
        n_blocks = len(self._block_start)
        return staged_blocks(n_blocks, self.rank, self.world_size, self.seed, staged["blocks_per_rank"])

    def _epoch_blocks(self, epoch):
        if self._staged is None:
            return deal_blocks(len(self._block_start), self.rank, self.world_size, self.seed, epoch)
        if epoch == 0:
            return self._staged
        if epoch == 1:  # once per loader
            print(
                f"warning: rank {self.rank} has read all {len(self._staged)} blocks staged for it (the run outgrew "
                f"the staging budget); it reads them again, reshuffled (said once).",
                file=sys.stderr,
                flush=True,
            )
        return np.random.default_rng([self.seed, epoch]).permutation(self._staged)

    def _read(self, index, start, end):
        array, file = self.arrays[index], self._files[index]
        if file is None:
            return np.array(array[start:end])
        tokens = np.empty(end - start, dtype=array.dtype)
        file.seek(array.offset + start * array.itemsize)
        if file.readinto(tokens) != tokens.nbytes:
            raise ValueError(
                f"{array.filename} ended before token {array.offset // array.itemsize + end:,}: it "
                f"shrank after the start-up checks."
            )
        return tokens

    def _block_windows(self, block):
        """All usable windows of one block as a (k, seq_len + 1) uint16 array, from one contiguous read."""
        index, window = self._block_array[block], self.seq_len + 1
        start, end = int(self._block_start[block]), int(self._block_end[block])
        if not self.doc_aligned:
            end = start + (end - start) // window * window
        tokens = self._read(index, start, end)
        if not self.doc_aligned:
            windows = tokens.reshape(-1, window)
        else:
            offsets = _doc_window_starts(np.flatnonzero(tokens == self.bos_id), window, end - start)
            windows = tokens[offsets[:, None] + np.arange(window)]
        if self.vocab_size is None or int(tokens.max()) < self.vocab_size:
            return windows
        keep = windows.max(axis=1, initial=0) < self.vocab_size
        self.bad_windows += len(keep) - int(keep.sum())
        if not self._warned:
            self._warned = True
            at, array = int(np.argmax(tokens >= self.vocab_size)), self.arrays[index]
            where = (
                f"{array.filename} at token {array.offset // array.itemsize + start + at:,}"
                if _is_file_map(array)
                else f"training array {index} at token {start + at:,}"
            )
            print(
                f"warning: rank {self.rank}: {where} holds id {tokens[at]} >= vocab_size {self.vocab_size}; "
                f"every window holding such an id is skipped and counted (said once).",
                file=sys.stderr,
                flush=True,
            )
        return windows[keep]

    def _batches(self):
        """(epoch, ring slot) of each batch, filled on this thread."""
        rows, slot = 0, -1
        ring = self._ring.numpy()
        for epoch in itertools.count():
            found = False
            for block in self._epoch_blocks(epoch):
                if self._block_array[block] in self._damaged:
                    continue
                try:
                    windows = self._block_windows(block)
                except (OSError, ValueError) as error:  # a file truncated or made unreadable under the run
                    self._skip_damaged(self._block_array[block], error)
                    continue
                found = found or len(windows) > 0
                while len(windows):
                    if rows == 0:
                        slot = (slot + 1) % len(ring)
                        if self._pin:
                            self._copied[slot].synchronize()  # the copy out of this slot's last batch is done
                        x, y = ring[slot]
                    take = min(self.batch_size - rows, len(windows))
                    # numpy casts uint16 -> int64 on this thread alone; torch's copy_ would wake its
                    # intra-op thread pool, which then competes with the training process for cores
                    x[rows : rows + take] = windows[:take, :-1]
                    y[rows : rows + take] = windows[:take, 1:]
                    rows, windows = rows + take, windows[take:]
                    if rows == self.batch_size:
                        yield epoch, slot
                        rows = 0
            if not found and self.bad_windows:
                raise ValueError(
                    f"every window of rank {self.rank}'s share of the data holds a token id >= "
                    f"vocab_size {self.vocab_size}."
                )
            if not found:
                raise ValueError(
                    f"no window of seq_len + 1 = {self.seq_len + 1} tokens starting at BOS id "
                    f"{self.bos_id} fits in the data; documents are too sparse for --doc_aligned."
                )

    def _skip_damaged(self, index, error):
        """Stop reading a file that changed under the run, said once per file; every rank skips it when it meets it,
        so no collective is needed. With no file left the loader fails, and the run stops with what it trained."""
        self._damaged.add(index)
        array = self.arrays[index]
        name = array.filename if _is_file_map(array) else f"training array {index}"
        print(
            f"warning: rank {self.rank}: {name} changed under the run ({error}); it is skipped from here on.",
            file=sys.stderr,
            flush=True,
        )
        if len(self._damaged) == len(self.arrays):
            raise DataChanged(f"every training file changed under the run; rank {self.rank} has nothing left to read.")

    def _produce(self):
        if self._pin:  # else this thread's CUDA calls (event waits) would open a CUDA context on cuda:0
            torch.cuda.set_device(self.device)
        try:
            for item in self._batches():
                if not self._put(item):
                    return
        except Exception as error:  # handed to the training loop, which re-raises it
            self._put(error)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise RuntimeError("this BatchLoader is closed.")
        item = self._queue.get()
        if isinstance(item, Exception):
            self.close()
            raise item
        self.epoch, slot = item
        x, y = self._ring[slot]  # copied out: the slot is refilled once the next batch is taken
        x = x.to(self.device, non_blocking=self._pin, copy=True)
        y = y.to(self.device, non_blocking=self._pin, copy=True)
        if self._pin:
            self._copied[slot].record(torch.cuda.current_stream(self.device))  # the stream the copies went on
        return x, y

    def close(self):
        self._stop.set()
        self._thread.join()
        for file in self._files:
            if file is not None:
                file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def val_batches(val, seq_len, batch_size, rank, world_size, max_tokens=None):
    """This rank's fixed validation batches: disjoint windows of the first max_tokens validation tokens, the same
    count per rank (the remainder is dropped) so all ranks run the same number of forward passes."""
    tokens, window = val[:max_tokens], seq_len + 1
    per_rank = len(tokens) // window // world_size
    if per_rank == 0:
        raise ValueError(
            f"the validation set has {len(tokens)} tokens, fewer than one window of seq_len + 1 = "
            f"{window} per rank for {world_size} ranks; raise --val_tokens."
        )
    mine = np.asarray(tokens[rank * per_rank * window : (rank + 1) * per_rank * window], dtype=np.int64)
    windows = torch.from_numpy(mine.reshape(per_rank, window))
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(batch_size)]


def _synthetic_probs(n_successors, doc_len):
    """The successor probabilities shared by every state: slot 0 is BOS (a document ends after ~doc_len tokens),
    the rest fall off as 1/rank, like word frequencies."""
    if n_successors < 2 or doc_len <= 1:
        raise ValueError(f"synthetic data needs n_successors >= 2 and doc_len > 1, got {n_successors}, {doc_len}.")
    zipf = 1.0 / np.arange(1, n_successors)
    return np.concatenate([[1.0 / doc_len], (1.0 - 1.0 / doc_len) * zipf / zipf.sum()])


def synthetic_entropy_nats(n_successors=8, doc_len=256):
    """Entropy rate of synthetic_tokens in nats/token: every state has n_successors distinct successors with the
    same probabilities p, so the rate is H(p) whatever the stationary distribution. The forced s -> BOS lane joins
    in synthetic_tokens (>= 64 * doc_len tokens apart) raise the best loss by < log(doc_len) / (64 * doc_len),
    3e-4 nats at the defaults."""
    p = _synthetic_probs(n_successors, doc_len)
    return float(-(p * np.log(p)).sum())


def synthetic_tokens(n_tokens, vocab_size=32000, seed=0, n_states=SYNTH_STATES, n_successors=8, doc_len=256, part=0):
    """n_tokens uint16 ids from a sparse Markov chain over n_states ids of the vocabulary (state 0 is BOS_ID; the
    others avoid ids 0-2). seed fixes the chain, part picks an independent stretch of it (one per file)."""
    if not n_successors < n_states <= vocab_size - 2:
        raise ValueError(
            f"synthetic data needs n_successors < n_states <= vocab_size - 2, got {n_successors}, "
            f"{n_states}, {vocab_size}."
        )
    probs = _synthetic_probs(n_successors, doc_len)
    rng = np.random.default_rng([seed, 0])
    ids = np.concatenate([[BOS_ID], rng.choice(np.arange(3, vocab_size), n_states - 1, replace=False)])
    # distinct non-BOS successors per state; every state but BOS itself (no empty documents) ends docs via slot 0
    successors = rng.random((n_states, n_states - 1)).argpartition(n_successors - 1, axis=1)[:, :n_successors] + 1
    successors[1:, 0] = 0
    successors = successors.astype(np.int32).ravel()

    # many chains ("lanes") advance together: a Python loop over lane length only, vectorised over lanes
    rng = np.random.default_rng([seed, 1, part])
    lanes = int(np.clip(n_tokens // (64 * doc_len), 1, 1024))
    steps = -(-n_tokens // lanes) + 1  # + 1: a lane ending in BOS drops that token
    uniform, slots = rng.random((steps, lanes)), np.zeros((steps, lanes), dtype=np.uint8)
    for edge in np.cumsum(probs)[:-1]:  # inverse CDF; k - 1 compares are ~3x faster than searchsorted here
        slots += uniform >= edge
    walk = np.zeros((steps, lanes), dtype=np.int32)  # row 0: every lane starts a document (state 0 = BOS)
    for t in range(steps - 1):
        np.take(successors, walk[t] * n_successors + slots[t], out=walk[t + 1])
    walk = walk.T
    keep = np.ones(walk.shape, dtype=bool)
    keep[:, -1] = walk[:, -1] != 0  # so each lane join (s -> BOS) is a transition the chain can make
    return ids.astype(np.uint16)[walk[keep][:n_tokens]]


def write_synthetic(
    out_dir,
    n_tokens,
    chunk_tokens=1 << 24,
    vocab_size=32000,
    seed=0,
    n_states=SYNTH_STATES,
    n_successors=8,
    doc_len=256,
):
    """Write n_tokens synthetic tokens in the event format: chunk_0001.bin, chunk_0002.bin, ..."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for part, start in enumerate(range(0, n_tokens, chunk_tokens)):
        tokens = synthetic_tokens(
            min(chunk_tokens, n_tokens - start), vocab_size, seed, n_states, n_successors, doc_len, part=part
        )
        paths.append(out / f"chunk_{part + 1:04d}.bin")
        tokens.astype("<u2").tofile(paths[-1])
    return paths


def _cli_check(args):
    start = time.perf_counter()
    s = check_token_files(find_token_files(args.data_dir), args.vocab_size, args.seq_len, full=args.full)
    print(f"ok: {s['files']} files, {s['tokens']:,} tokens ({2 * s['tokens'] / 2**30:.2f} GiB) in {args.data_dir}")
    checked = "every token" if args.full else f"sampled {s['checked_tokens']:,} tokens"
    print(f"{checked}: ids {s['min_id']}..{s['max_id']} (--vocab_size {args.vocab_size})")
    mean_doc = f", ~{1 / s['bos_rate']:,.0f} tokens per document" if s["bos_rate"] else ""
    print(f"BOS id {BOS_ID}: rate {s['bos_rate']:.2e}{mean_doc}: {'detected' if s['has_bos'] else 'not detected'}")
    print(f"checked in {time.perf_counter() - start:.2f} s")


def _cli_synth(args):
    start = time.perf_counter()
    paths = write_synthetic(
        args.out_dir,
        args.tokens,
        args.chunk_tokens,
        args.vocab_size,
        args.seed,
        args.n_states,
        args.n_successors,
        args.doc_len,
    )
    print(
        f"wrote {args.tokens:,} tokens in {len(paths)} files to {args.out_dir} in {time.perf_counter() - start:.1f}"
        f" s; entropy rate {synthetic_entropy_nats(args.n_successors, args.doc_len):.4f} nats/token"
    )


def _cli_bench(args):
    torch.set_num_threads(1)  # the compute loop gets one core, the loader thread another
    data = load_token_data(args.data_dir, args.vocab_size, args.seq_len, val_tokens=0)
    a = torch.randn(args.matmul, args.matmul)

    def timed(loader, compute):
        """Seconds for args.batches iterations of (next batch, matmul), and the part spent in next()."""
        waited, start = 0.0, time.perf_counter()
        for _ in range(args.batches):
            if loader is not None:
                asked = time.perf_counter()
                next(loader)
                waited += time.perf_counter() - asked
            if compute:
                a @ a
        return time.perf_counter() - start, waited

    def with_loader(compute):
        with BatchLoader(
            data.train, args.seq_len, args.batch_size, 0, 1, doc_aligned=args.doc_aligned, bos_id=data.bos_id
        ) as loader:
            return timed(loader, compute)

    for label in ("first pass", "page cache"):  # the first pass reads exactly the windows the second one times
        seconds, _ = with_loader(compute=False)
        print(
            f"loader ({label}): {args.batches * args.batch_size * args.seq_len / seconds / 1e6:.1f}M tokens/s "
            f"({1e3 * seconds / args.batches:.2f} ms/batch of {args.batch_size} x {args.seq_len})"
        )
    alone, shared = [], []
    for _ in range(3):  # alternate and keep the best of each: other processes share this machine
        alone.append(timed(None, compute=True)[0])
        shared.append(with_loader(compute=True))
    alone, (shared, waited) = min(alone) / args.batches, [t / args.batches for t in min(shared)]
    print(
        f"compute loop ({args.matmul}^2 matmul + one batch per iteration, best of 3): alone {1e3 * alone:.2f} "
        f"ms/iter, with loader {1e3 * shared:.2f} ms/iter ({100 * (shared / alone - 1):+.1f}%, of which "
        f"{1e3 * waited:.3f} ms/iter in next())"
    )


def data_cli(argv=None):
    parser = argparse.ArgumentParser(prog="data.py", description="Check, synthesise or benchmark token data.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a folder of chunk_*.bin files and summarise it")
    check.add_argument("data_dir")
    check.add_argument("--full", action="store_true", help="read every token, not a sample (minutes on NFS)")
    synth = commands.add_parser("synth", help="write the synthetic Markov data in the event format")
    synth.add_argument("out_dir")
    synth.add_argument("--tokens", type=lambda s: int(float(s)), required=True, help="e.g. 1e8")
    synth.add_argument("--chunk_tokens", type=lambda s: int(float(s)), default=1 << 24)
    for name, default in (("seed", 0), ("n_states", SYNTH_STATES), ("n_successors", 8), ("doc_len", 256)):
        synth.add_argument(f"--{name}", type=int, default=default)
    bench = commands.add_parser("bench", help="loader tokens/s and its cost to a concurrent compute loop")
    bench.add_argument("data_dir")
    bench.add_argument("--batch_size", type=int, default=64)
    bench.add_argument("--batches", type=int, default=300)
    bench.add_argument("--matmul", type=int, default=512, help="matrix size of the compute loop")
    bench.add_argument("--doc_aligned", action="store_true")
    for sub in (check, synth, bench):
        sub.add_argument("--vocab_size", type=int, default=32000)
    for sub in (check, bench):
        sub.add_argument("--seq_len", type=int, default=1024)
    args = parser.parse_args(argv)
    try:
        {"check": _cli_check, "synth": _cli_synth, "bench": _cli_bench}[args.command](args)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    data_cli()

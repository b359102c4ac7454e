"""Token data for the speedrun trainer: folders of token files (chunk_*.bin, or modded-nanogpt's *_train_*.bin) of
one of windows.token_layout's formats (raw uint16, the event's; raw uint32; llm.c's headered shards).

check_token_files catches bad data in seconds (it samples; `check --full` scans every token, off the clock);
load_token_data memmaps the files and holds out a validation range (or builds the synthetic set, synthetic.py);
BatchLoader serves one rank's batches from three parts: shards.py deals the blocks a rank reads (from a folder
stage.py wrote, only the blocks staged for it), windows.py reads and checks their windows, prefetch.py keeps batches
ready in a background thread; val_batches cuts the fixed validation batches.
CLI (data_cli.py, which imports this): python data_cli.py check DIR [--full] | synth OUT_DIR --tokens N | bench DIR
"""

import dataclasses
import itertools
import pathlib
import resource
from typing import TypedDict

import numpy as np
import torch

# the loader's parts: callers import their names from them, not from here
from prefetch import Prefetcher
from shards import Shards
from synthetic import SYNTH_STATES, synthetic_entropy_nats, synthetic_tokens
from windows import BOS_ID, MAX_OPEN_FILES, WindowReader, is_file_map, token_layout, token_map

BOS_RATE_RANGE = (1e-5, 0.05)  # a marker once per 20..100k tokens looks like document starts, not a common token
SYNTH_TRAIN_TOKENS = 1 << 23  # embedded default data: ~8M training tokens, generated in well under a second
SAMPLE_TOKENS = 1 << 18  # per file, read by the start-up check
FD_RESERVE = 256  # open files a run needs besides its token files: torch's libraries, the loader, sockets, logs


TRAIN_GLOBS = ("chunk_*.bin", "*_train_*.bin")  # the event's names, else modded-nanogpt's and llm.c's (fineweb_train_)


def find_token_files(data_dir):
    """The folder's chunk_*.bin files in name order (the event files are zero-padded); in a folder without any, its
    *_train_*.bin files (modded-nanogpt's fineweb_train_000001.bin ...; their fineweb_val_*.bin is a --val_file).
    Anything by that name that is not a readable file is an error, not skipped: a silently missing chunk changes the
    data."""
    folder = pathlib.Path(data_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"--data_dir {folder} does not exist or is not a folder.")
    files = next((found for pattern in TRAIN_GLOBS if (found := sorted(folder.glob(pattern)))), [])
    for path in files:
        if path.is_symlink() and not path.exists():
            raise FileNotFoundError(f"{path} is a broken symlink (to {path.readlink()}).")
        if not path.is_file():
            raise ValueError(f"{path} is {'a folder' if path.is_dir() else 'not a regular file'}, not a token file.")
    if not files:
        raise FileNotFoundError(f"--data_dir {folder} holds no chunk_*.bin (or *_train_*.bin) token files.")
    return files


def token_layouts(files, token_dtype="uint16"):
    """Each file's windows.TokenLayout (raw files hold token_dtype ids); files of more than one format are a
    ValueError: a folder is one data set, written one way."""
    layouts = [token_layout(path, token_dtype) for path in files]
    if other := next((i for i, layout in enumerate(layouts) if layout.name != layouts[0].name), None):
        raise ValueError(
            f"the token files mix formats: {files[0]} is {layouts[0].name}, {files[other]} is {layouts[other].name}; "
            f"write them all one way (python data_cli.py prepare writes either)."
        )
    return layouts


def open_file_room(n_files):
    """Make room for a run's open files: each training file is memory-mapped (one descriptor each, for the run), the
    reader holds up to MAX_OPEN_FILES more, and torch, the loader and the process group need some (FD_RESERVE). A
    soft limit (`ulimit -n`, often 1024) below that is raised up to the hard limit: returns the note to log, or None
    when there was room. A hard limit below it is a ValueError, here and in `python data_cli.py check` alike."""
    need = n_files + MAX_OPEN_FILES + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(
            f"the {n_files} token files need about {need} open files, but this process may open at most {hard} "
            f"(the hard `ulimit -n`); merge the files into fewer, or raise the hard limit."
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return f"open-file limit raised from {soft} to {need} for {n_files} files"


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


def _sample_file(path, layout, ranges):
    dtype = layout.dtype
    with open(path, "rb") as file:
        slices = []
        for start, end in ranges:
            file.seek(layout.header + start * dtype.itemsize)
            slices.append(np.frombuffer(file.read((end - start) * dtype.itemsize), dtype=dtype))
    return np.concatenate(slices)


def _file_chunks(path, layout, chunk_tokens=1 << 24):
    """Every token of a file, in reads of chunk_tokens."""
    with open(path, "rb") as file:
        file.seek(layout.header)
        while len(chunk := np.fromfile(file, dtype=layout.dtype, count=chunk_tokens)):
            yield chunk


class IdStats(TypedDict):
    """Tokens seen, min (None before the first token) and max id, bos_id count, and the ids >= vocab_size: how many,
    the first one and its position (counted over the chunks in order)."""

    seen: int
    min: int | None
    max: int
    bos: int
    bad: int
    first_bad: tuple[int, int] | None


def _id_stats(chunks, vocab_size, bos_id) -> IdStats:
    """The IdStats of the tokens of chunks."""
    stats: IdStats = {"seen": 0, "min": None, "max": 0, "bos": 0, "bad": 0, "first_bad": None}
    for chunk in chunks:
        low, high = int(chunk.min()), int(chunk.max())
        stats["min"] = low if stats["min"] is None else min(stats["min"], low)
        stats["max"] = max(stats["max"], high)
        stats["bos"] += int(np.count_nonzero(chunk == bos_id))
        if high >= vocab_size:
            bad = np.flatnonzero(chunk >= vocab_size)
            if stats["first_bad"] is None:
                stats["first_bad"] = (int(chunk[bad[0]]), stats["seen"] + int(bad[0]))
            stats["bad"] += len(bad)
        stats["seen"] += len(chunk)
    return stats


def _summarise(n_files, n_tokens, file_stats, layout_name, bos_id):
    seen = sum(stats["seen"] for stats in file_stats)
    bos_rate = sum(stats["bos"] for stats in file_stats) / seen
    return {
        "files": n_files,
        "format": layout_name,
        "tokens": n_tokens,
        "checked_tokens": seen,
        "min_id": min(stats["min"] for stats in file_stats),
        "max_id": max(stats["max"] for stats in file_stats),
        "bos_id": bos_id,
        "bos_rate": bos_rate,
        "has_bos": bool(BOS_RATE_RANGE[0] <= bos_rate <= BOS_RATE_RANGE[1]),
    }


def check_token_files(
    files, vocab_size, seq_len, sample_tokens=SAMPLE_TOKENS, full=False, token_dtype="uint16", bos_id=None, layouts=None
):
    """Validate token files from their layouts (token_layouts, unless given) and ~sample_tokens sampled tokens each
    (every token if full); return a summary, with the rate of bos_id (None: the format's marker). Sparse bad ids can
    pass the sample: BatchLoader checks every token it reads."""
    layouts = token_layouts(files, token_dtype) if layouts is None else layouts
    for path, layout in zip(files, layouts):  # sizes first: cheap, so every file is checked before any is read
        if layout.count < seq_len + 1:
            raise ValueError(
                f"{path} holds {layout.count} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}."
            )
    bos_id = layouts[0].marker if bos_id is None else bos_id
    sizes = [layout.count for layout in layouts]
    file_stats, problems = [], []
    for path, layout, ranges in zip(files, layouts, sample_slices(sizes, sample_tokens)):
        chunks = _file_chunks(path, layout) if full else [_sample_file(path, layout, ranges)]
        stats = _id_stats(chunks, vocab_size, bos_id)
        if stats["first_bad"] is not None and full:
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
    return _summarise(len(files), sum(sizes), file_stats, layouts[0].name, bos_id)


@dataclasses.dataclass
class TokenData:
    train: list  # 1-D uint16 or uint32 arrays (np.memmap of the files)
    val: np.ndarray  # 1-D, in memory, never part of train
    summary: dict
    bos_id: int | None  # the document marker, when the data marks document starts with it
    source: str  # one line for the log


def load_token_data(data_dir, vocab_size, seq_len, val_tokens, val_file=None, token_dtype="uint16", bos_id=None):
    """Checked training arrays and validation tokens from data_dir, or the synthetic set when data_dir is None.
    Validation is the last val_tokens of the last file (cut from its training view), or val_file if given (its format
    detected on its own). Raw files hold token_dtype ids; bos_id: the document marker (None: the format's)."""
    if val_tokens < 0:
        raise ValueError(f"--val_tokens must be >= 0, got {val_tokens}.")
    if data_dir is None:
        return _synthetic_data(vocab_size, seq_len, val_tokens)
    files = find_token_files(data_dir)
    fd_note = open_file_room(len(files))
    layouts = token_layouts(files, token_dtype)
    summary = check_token_files(files, vocab_size, seq_len, token_dtype=token_dtype, bos_id=bos_id, layouts=layouts)
    train = [token_map(path, layout) for path, layout in zip(files, layouts)]
    if val_file is not None:
        if not pathlib.Path(val_file).is_file():
            raise FileNotFoundError(f"--val_file {val_file} does not exist.")
        val_layout = token_layout(val_file, token_dtype)
        check_token_files([pathlib.Path(val_file)], vocab_size, seq_len, layouts=[val_layout], bos_id=summary["bos_id"])
        count = min(val_tokens, val_layout.count)
        val = np.fromfile(val_file, val_layout.dtype, count=count, offset=val_layout.header)
        where = f"first {len(val):,} tokens of {val_file}"
    else:
        cut = len(train[-1]) - val_tokens
        if cut < seq_len + 1:
            raise ValueError(
                f"{files[-1]} holds {len(train[-1])} tokens, too few for --val_tokens {val_tokens} plus "
                f"one training window; lower --val_tokens or pass --val_file."
            )
        layout = layouts[-1]
        train[-1] = token_map(files[-1], layout, cut)  # a new map, not a slice: the reader preads file maps
        val = np.fromfile(files[-1], layout.dtype, count=val_tokens, offset=layout.header + cut * layout.dtype.itemsize)
        where = f"last {val_tokens:,} tokens of {files[-1].name}"
    if len(val) and (top := int(val.max())) >= vocab_size:  # in memory already: every validation token is checked
        at = int(np.argmax(val >= vocab_size))
        raise ValueError(
            f"the validation tokens ({where}) hold ids >= --vocab_size {vocab_size} (up to {top}), the "
            f"first at validation token {at:,}."
        )
    bos_id = summary["bos_id"] if summary["has_bos"] else None
    marker = f"id {summary['bos_id']} {'' if bos_id is not None else 'not '}detected"
    source = (
        f"{len(files)} files ({summary['format']}) in {data_dir}, {sum(map(len, train)):,} training tokens, "
        f"validation = {where}, document marker {marker} (rate {summary['bos_rate']:.1e})"
        + (f"; {fd_note}" if fd_note else "")
    )
    return TokenData(train, val, summary, bos_id, source)


def _synthetic_data(vocab_size, seq_len, val_tokens):
    n_states = min(SYNTH_STATES, vocab_size - 2)  # so any --vocab_size above ~10 still runs
    tokens = synthetic_tokens(SYNTH_TRAIN_TOKENS + val_tokens, vocab_size, n_states=n_states)
    floor = synthetic_entropy_nats()
    stats = [_id_stats([tokens], vocab_size, BOS_ID)]
    summary = {**_summarise(1, len(tokens), stats, "synthetic", BOS_ID), "entropy_floor_nats": floor}
    source = (
        f"synthetic Markov chain ({n_states} states), {SYNTH_TRAIN_TOKENS:,} training + {val_tokens:,} "
        f"validation tokens, best possible loss {floor:.4f} nats/token"
    )
    return TokenData([tokens[:SYNTH_TRAIN_TOKENS]], tokens[SYNTH_TRAIN_TOKENS:], summary, BOS_ID, source)


class BatchLoader(Prefetcher):
    """Endless (x, y) int64 batches of shape (batch_size, seq_len) for one rank, y = x shifted by one: the blocks
    shards.Shards deals this rank (see shards.py: rank-disjoint, reshuffled every epoch; a staged folder's own
    share), their windows read and checked by windows.WindowReader (see windows.py: doc alignment, bad ids, damaged
    files), served by prefetch.Prefetcher (see prefetch.py: the ring, the thread, the CUDA copies).
    arrays: 1-D token arrays (TokenData.train); spec: WindowSpec; deal: Deal; device and prefetch_tokens: the
    Prefetcher's. .epoch: the epoch of the last batch served (a rank whose share is used up starts the next, a new
    shuffle, instead of stopping); .bad_windows: windows dropped for an id >= vocab_size, counted by the reading
    thread, so it runs ahead of the batches served by up to the prefetch. .position: the windows.Where of the next
    window (start: a resumed run's, served from there on).
    """

    def __init__(self, arrays, spec, batch_size, deal, device="cpu", prefetch_tokens=None, start=None):
        self.arrays, self.spec, self.deal = arrays, spec, deal
        folder = pathlib.Path(arrays[0].filename).parent if arrays and is_file_map(arrays[0]) else None
        self.shards = Shards([len(array) for array in arrays], spec.seq_len, deal, folder)
        self.reader = WindowReader(arrays, spec, deal.rank)
        try:
            # the first usable range is read here, before the step-0 save: data in which no window can be formed
            # (--doc_aligned with no document long enough, every id >= vocab_size) is a ValueError now, not later
            stream = self.reader.stream(self.shards.ranges, start)
            windows = itertools.chain([next(stream)], stream)
            name = f"batch-loader-{deal.rank}"
            super().__init__(windows, batch_size, spec.seq_len, device, prefetch_tokens, name, start)
        except BaseException:
            self.reader.close()
            raise

    @property
    def bad_windows(self):
        return self.reader.bad_windows

    def close(self):
        super().close()
        self.reader.close()


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


if __name__ == "__main__":  # the CLI imports this library, never the reverse: say where it is
    raise SystemExit("the data CLI is data_cli.py: python data_cli.py check|synth|bench ... (--help for more)")

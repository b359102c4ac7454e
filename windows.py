"""The window reader: the token-file formats (token_layout: raw uint16 or uint32 ids, llm.c's headered shards), and
the training windows (seq_len + 1 tokens each) of token ranges.

File maps (an np.memmap made straight from a token file) are read with one pread per range: far fewer round trips
than page faults on NFS; other arrays are sliced. doc_aligned: each window starts at a bos_id token (greedy,
disjoint; the tokens between a window's end and the next BOS are skipped), as in modded-nanogpt. vocab_size: every
range read is checked (a max over its tokens, cheap next to the read); a window holding an id >= vocab_size is
dropped and counted in .bad_windows, and the first bad id is named once on stderr. The start-up check samples, so
sparse bad ids cost a few windows here instead of an IndexError mid-run (on CUDA, a device-side assert that kills the
context): no id >= vocab_size reaches the model. A file that shrinks, becomes unreadable or is replaced by something
that is not a file under the run is skipped from then on, said once per file; with no file left, or no usable window
left in a rank's share once it had some (its files rewritten with other ids), DataChanged. numpy + stdlib only.
"""

import collections
import dataclasses
import itertools
import mmap
import os
import stat
import sys
from typing import NamedTuple

import numpy as np

# The token files. Raw little-endian ids without a header are the event's format: uint16 by default, uint32 by
# --token_dtype. llm.c's and modded-nanogpt's shards open with a 256 x int32 header (magic, version, token count) that
# names their dtype, detected per file. eval.py holds a deliberate copy (it runs beside model.py alone, in the
# organizers' folder).
TOKEN_DTYPE = np.dtype("<u2")
RAW_DTYPES: dict[str, np.dtype] = {"uint16": TOKEN_DTYPE, "uint32": np.dtype("<u4")}
HEADER_BYTES = 256 * 4


class LlmcFormat(NamedTuple):
    """An llm.c header's format: its version, the ids' dtype, the marker its writers put at each document's start."""

    version: int
    dtype: np.dtype
    marker: int


# magic: its format. 20240520: GPT-2's ids, every document opened by <|endoftext|>; 20240801: Llama-3's, opened by
# <|begin_of_text|> (llm.c's dev/data/fineweb.py)
LLMC_HEADERS = {20240520: LlmcFormat(1, np.dtype("<u2"), 50256), 20240801: LlmcFormat(7, np.dtype("<u4"), 128000)}
BOS_ID = 1  # document start in Llama/Mistral-style 32K vocabularies: the marker of raw files
MAX_OPEN_FILES = 64  # token files a reader holds open at once (each block read is one file's; reopening is cheap)


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Where a token file's ids lie: count ids of dtype after header bytes. name: the format, for messages; marker:
    the id its writers open each document with (the --bos_id that "auto" means)."""

    name: str
    dtype: np.dtype
    header: int
    count: int
    marker: int


def token_layout(path, token_dtype="uint16"):
    """The layout of the token file at path, from its first bytes: an llm.c header, else raw ids of token_dtype.
    A header that disagrees with the file's size, or a raw file that is not whole ids, is a ValueError."""
    n_bytes = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    magic = int.from_bytes(head[:4], "little") if len(head) >= 4 else None
    if magic not in LLMC_HEADERS:
        dtype = RAW_DTYPES[token_dtype]
        count, rest = divmod(n_bytes, dtype.itemsize)
        if rest:
            size = "an odd size" if dtype.itemsize == 2 else f"a size that is not a multiple of {dtype.itemsize}"
            raise ValueError(f"{path} has {size} ({n_bytes} bytes), so it is not a file of {token_dtype} tokens.")
        return TokenLayout(f"raw {token_dtype}", dtype, 0, count, BOS_ID)
    version, dtype, marker = LLMC_HEADERS[magic]
    name = f"llm.c {dtype.name} (magic {magic})"
    header = np.frombuffer(head.ljust(HEADER_BYTES, b"\0"), dtype="<i4")
    if len(head) < HEADER_BYTES or header[1] != version:
        raise ValueError(
            f"{path} opens with llm.c's magic {magic} but not its {HEADER_BYTES}-byte header of version {version}: "
            f"it is damaged or another format."
        )
    count = int(header[2])
    if n_bytes != HEADER_BYTES + count * dtype.itemsize:
        raise ValueError(
            f"{path}'s {name} header says {count:,} tokens ({HEADER_BYTES + count * dtype.itemsize:,} bytes with the "
            f"header), but the file holds {n_bytes:,} bytes: it is truncated or its header is wrong."
        )
    return TokenLayout(name, dtype, HEADER_BYTES, count, marker)


def token_map(path, layout, count=None):
    """The first count ids (default: all) of a token file as a file map (is_file_map: the reader preads it)."""
    shape = (layout.count if count is None else count,)
    return np.memmap(path, dtype=layout.dtype, mode="r", offset=layout.header, shape=shape)


def first_token(array, file):
    """The position in its file (open as file) of a file map's first id: its offset past an llm.c header, if any."""
    header = HEADER_BYTES if int.from_bytes(os.pread(file.fileno(), 4, 0), "little") in LLMC_HEADERS else 0
    return (array.offset - header) // array.itemsize


class DataChanged(ValueError):
    """The training data changed under a running job until this rank has no usable window left to read."""


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """What a training window is: seq_len + 1 tokens, starting at a bos_id token when doc_aligned, every id below
    vocab_size when that is given."""

    seq_len: int
    doc_aligned: bool = False
    bos_id: int | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        if self.doc_aligned and self.bos_id is None:
            raise ValueError("--doc_aligned needs BOS document markers (--bos_id), but none were detected in the data.")


def is_file_map(array):
    """True for an np.memmap made straight from a file, not sliced from one: only then do .filename and .offset
    say where its first token is."""
    return isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap)


def doc_window_starts(bos, window, limit):
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


class Where(NamedTuple):
    """A place in a rank's deal: the epoch, a range's ordinal in it, and a window's index among the range's usable
    windows. What a loader has served is the Where of the next window it would serve."""

    epoch: int
    ordinal: int = 0
    first: int = 0


class WindowReader:
    """The usable windows of token ranges of the arrays (1-D token arrays, file maps read with pread) for one rank,
    which its messages name; close() closes the files it opened."""

    def __init__(self, arrays, spec, rank=0):
        self.arrays, self.spec, self.rank = arrays, spec, rank
        self.bad_windows, self._warned, self._damaged = 0, False, set()
        self._files = collections.OrderedDict()  # array index -> its open file, the most recently read last

    def _file(self, index):
        """The open file of array index, or None for an array in memory; at most MAX_OPEN_FILES are held (the least
        recently read is closed first), so a folder of thousands of files needs no more descriptors than a few."""
        array = self.arrays[index]
        if not is_file_map(array):
            return None
        if index in self._files:
            self._files.move_to_end(index)
            return self._files[index]
        if len(self._files) >= MAX_OPEN_FILES:
            self._files.popitem(last=False)[1].close()
        fd = os.open(array.filename, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in the file's place must not block us
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{array.filename} is no longer a regular file")
        os.set_blocking(fd, True)  # reads of a regular file, as before
        self._files[index] = open(fd, "rb")
        return self._files[index]

    def stream(self, epoch_ranges, start=None):
        """(Where, windows) for each range that holds a usable window, epoch after epoch: epoch_ranges(epoch) gives
        that epoch's (array index, start, end) token ranges. From start (a Where: a resumed run's place in the deal),
        or from the first. An epoch without a usable window is a ValueError when none was ever served (data no window
        can be formed of) and DataChanged after (data that changed under the run)."""
        start = start or Where(0)
        resumed = (start.ordinal, start.first) != (0, 0)
        served = resumed
        for epoch in itertools.count(start.epoch):
            found, bad_before = epoch == start.epoch and resumed, self.bad_windows
            for ordinal, (index, begin, end) in enumerate(epoch_ranges(epoch)):
                if epoch == start.epoch and ordinal < start.ordinal:
                    continue  # read before the run was resumed
                first = start.first if (epoch, ordinal) == (start.epoch, start.ordinal) else 0
                windows = self.windows(index, begin, end)[first:]
                if len(windows):
                    found = served = True
                    yield Where(epoch, ordinal, first), windows
            if found:
                continue
            share = f"rank {self.rank}'s share of the data"
            if self.bad_windows > bad_before:
                why = f"every window of {share} holds a token id >= vocab_size {self.spec.vocab_size}"
            elif self._damaged:
                why = f"every file of {share} changed under the run"
            else:
                why = (
                    f"no window of seq_len + 1 = {self.spec.seq_len + 1} tokens starting at BOS id "
                    f"{self.spec.bos_id} fits in the data; documents are too sparse for --doc_aligned"
                )
            if served:
                raise DataChanged(f"{why}; it held usable windows before: the data changed under the run.")
            raise ValueError(f"{why}.")

    def windows(self, index, start, end):
        """All usable windows of tokens [start, end) of array index as a (k, seq_len + 1) array, from one contiguous
        read; none from a file found damaged (this time or before)."""
        if index not in self._damaged:
            try:
                return self._cut(index, start, end)
            except (OSError, ValueError) as error:  # a file truncated or made unreadable under the run
                self._skip_damaged(index, error)
        return np.empty((0, self.spec.seq_len + 1), dtype=TOKEN_DTYPE)

    def read(self, index, start, end):
        """Tokens [start, end) of array index."""
        array, file = self.arrays[index], self._file(index)
        if file is None:
            return np.array(array[start:end])
        tokens = np.empty(end - start, dtype=array.dtype)
        file.seek(array.offset + start * array.itemsize)
        if file.readinto(tokens) != tokens.nbytes:
            raise ValueError(
                f"{array.filename} ended before token {first_token(array, file) + end:,}: it "
                f"shrank after the start-up checks."
            )
        return tokens

    def _cut(self, index, start, end):
        window, spec = self.spec.seq_len + 1, self.spec
        if not spec.doc_aligned:
            end = start + (end - start) // window * window
        tokens = self.read(index, start, end)
        if not spec.doc_aligned:
            windows = tokens.reshape(-1, window)
        else:
            offsets = doc_window_starts(np.flatnonzero(tokens == spec.bos_id), window, end - start)
            windows = tokens[offsets[:, None] + np.arange(window)]
        if spec.vocab_size is None or int(tokens.max()) < spec.vocab_size:
            return windows
        keep = windows.max(axis=1, initial=0) < spec.vocab_size
        self.bad_windows += len(keep) - int(keep.sum())
        if not self._warned:
            self._warned = True
            self._warn_bad_id(tokens, index, start)
        return windows[keep]

    def _warn_bad_id(self, tokens, index, start):
        at, array = int(np.argmax(tokens >= self.spec.vocab_size)), self.arrays[index]
        where = (
            f"{array.filename} at token {first_token(array, self._file(index)) + start + at:,}"
            if is_file_map(array)
            else f"training array {index} at token {start + at:,}"
        )
        print(
            f"warning: rank {self.rank}: {where} holds id {tokens[at]} >= vocab_size {self.spec.vocab_size}; "
            f"every window holding such an id is skipped and counted (said once).",
            file=sys.stderr,
            flush=True,
        )

    def _skip_damaged(self, index, error):
        """Stop reading a file that changed under the run, said once per file; every rank skips it when it meets it,
        so no collective is needed. With no file left the loader fails, and the run stops with what it trained."""
        self._damaged.add(index)
        array = self.arrays[index]
        name = array.filename if is_file_map(array) else f"training array {index}"
        print(
            f"warning: rank {self.rank}: {name} changed under the run ({error}); it is skipped from here on.",
            file=sys.stderr,
            flush=True,
        )
        if len(self._damaged) == len(self.arrays):
            raise DataChanged(f"every training file changed under the run; rank {self.rank} has nothing left to read.")

    def close(self):
        while self._files:
            self._files.popitem()[1].close()

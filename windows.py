"""The window reader: the token-file format, and the training windows (seq_len + 1 tokens each) of token ranges.

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

import numpy as np

# The token files: raw little-endian uint16 ids, no header. eval.py holds a deliberate copy (it runs beside model.py
# alone, in the organizers' folder).
TOKEN_DTYPE = np.dtype("<u2")
BOS_ID = 1  # document start in Llama/Mistral-style 32K vocabularies
MAX_OPEN_FILES = 64  # token files a reader holds open at once (each block read is one file's; reopening is cheap)


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
            raise ValueError("--doc_aligned needs BOS document markers, but none were detected in the data.")


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

    def stream(self, epoch_ranges):
        """(epoch, windows) for each range that holds a usable window, epoch after epoch: epoch_ranges(epoch) gives
        that epoch's (array index, start, end) token ranges. An epoch without a usable window is a ValueError when
        none was ever served (data no window can be formed of) and DataChanged after (data that changed under the
        run)."""
        served = False
        for epoch in itertools.count():
            found, bad_before = False, self.bad_windows
            for index, start, end in epoch_ranges(epoch):
                windows = self.windows(index, start, end)
                if len(windows):
                    found = served = True
                    yield epoch, windows
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
                f"{array.filename} ended before token {array.offset // array.itemsize + end:,}: it "
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
            f"{array.filename} at token {array.offset // array.itemsize + start + at:,}"
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

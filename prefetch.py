"""The prefetcher: endless (x, y) int64 batches of shape (batch_size, seq_len), y = x shifted by one, packed from a
stream of (windows.Where, windows) by a daemon thread that keeps .depth batches ready.

prefetch_tokens worth (default: PREFETCH_TOKENS on CUDA, where a storage stall on one rank holds every rank; 2
batches elsewhere), in a fixed ring of host buffers, pinned on CUDA and copied with non_blocking=True; a slot is
refilled only after the caller took the next batch and, on CUDA, after its copy's event. Each batch served is the
caller's own tensor. Whatever ends the thread but close() (an error in the stream or in packing, of any type) is
raised by the next call to next() and every call after it, as windows.DataChanged: the batches stop, and the caller
stops the run with what it trained instead of waiting for a batch that is not coming.
"""

import queue
import threading
from contextlib import nullcontext

import torch

from windows import DataChanged, Where

# Loader prefetch on CUDA, as a token budget. Event arithmetic: a B300 at ~40% of 2.25 PFLOP/s bf16 on a
# ~1.5 GFLOP/token model trains ~600K tokens/s, so a 1 s storage stall on one rank is ~600K tokens, and one
# stalled rank holds all 32 at the next all-reduce. 2M tokens (32 MiB of pinned int64 x and y) ride out ~3.5 s.
PREFETCH_TOKENS = 1 << 21


class Prefetcher:
    """Batches of windows (k, seq_len + 1 arrays) from windows, an iterator of (Where, windows) that the thread
    consumes; .epoch is the epoch of the windows that completed the last batch served, .position the Where of the
    next window a batch would take (start, before any): where a resumed loader starts."""

    def __init__(self, windows, batch_size, seq_len, device="cpu", prefetch_tokens=None, name="prefetch", start=None):
        self.batch_size, self._windows = batch_size, windows
        self.position = start or Where(0)
        self.epoch = self.position.epoch
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        if self._pin and self.device.index is None:  # name the GPU: the loader thread must bind to it too
            self.device = torch.device("cuda", torch.cuda.current_device())
        if prefetch_tokens is None:
            prefetch_tokens = PREFETCH_TOKENS if self._pin else 0
        self.depth = max(2, -(-prefetch_tokens // (batch_size * seq_len)))
        # the queue holds depth slots, the thread fills one more and the caller copies out of one: with depth + 2
        # slots a slot is refilled only after the caller took the next one, and on CUDA after its copy event
        slots = self.depth + 2
        with torch.cuda.device(self.device) if self._pin else nullcontext():  # one cudaHostAlloc, not one per batch
            self._ring = torch.empty(slots, 2, batch_size, seq_len, dtype=torch.int64, pin_memory=self._pin)
        self._copied = [torch.cuda.Event() for _ in range(slots)] if self._pin else None
        self._queue: queue.Queue[tuple[Where, int] | BaseException] = queue.Queue(maxsize=self.depth)
        self._stop, self._error = threading.Event(), None
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._thread.start()

    def _fill(self):
        """(the Where after each batch, its ring slot), filled on this thread."""
        rows, slot = 0, -1
        ring = self._ring.numpy()
        for where, windows in self._windows:
            taken = where.first
            while len(windows):
                if rows == 0:
                    slot = (slot + 1) % len(ring)
                    if self._copied is not None:
                        self._copied[slot].synchronize()  # the copy out of this slot's last batch is done
                    x, y = ring[slot]
                take = min(self.batch_size - rows, len(windows))
                # numpy casts uint16 -> int64 on this thread alone; torch's copy_ would wake its
                # intra-op thread pool, which then competes with the training process for cores
                x[rows : rows + take] = windows[:take, :-1]
                y[rows : rows + take] = windows[:take, 1:]
                rows, taken, windows = rows + take, taken + take, windows[take:]
                if rows == self.batch_size:
                    yield Where(where.epoch, where.ordinal, taken), slot
                    rows = 0

    def _produce(self):
        if self._pin:  # else this thread's CUDA calls (event waits) would open a CUDA context on cuda:0
            torch.cuda.set_device(self.device)
        try:
            for item in self._fill():
                if not self._put(item):
                    return
        except BaseException as error:  # any end but close(): the caller must never wait on an empty queue
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
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RuntimeError(f"this {type(self).__name__} is closed.")
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            self._error = item
            if not isinstance(item, DataChanged):
                self._error = DataChanged(f"the {self._thread.name} thread stopped: {type(item).__name__}: {item}")
                self._error.__cause__ = item
            raise self._error
        self.position, slot = item
        self.epoch = self.position.epoch
        x, y = self._ring[slot]  # copied out: the slot is refilled once the next batch is taken
        x = x.to(self.device, non_blocking=self._pin, copy=True)
        y = y.to(self.device, non_blocking=self._pin, copy=True)
        if self._copied is not None:
            self._copied[slot].record(torch.cuda.current_stream(self.device))  # the stream the copies went on
        return x, y

    def close(self):
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

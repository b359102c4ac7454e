"""report.py's metrics file: rows queued by the loop and written by a thread of their own, so a stalled file system
(NFS at the event) never holds the training loop; every row lands, in order, and a writer stuck at the end is left
behind after a bound."""

import json
import threading
import time
from types import SimpleNamespace

import torch

import report
from report import Logger, MetricsFile, close_metrics


class BlockingFile:
    """A file whose writes wait for .gate, as a write to a stalled NFS mount does."""

    def __init__(self):
        self.gate, self.parts, self.closed = threading.Event(), [], False

    def write(self, text):
        self.gate.wait()
        self.parts.append(text)

    def flush(self):
        pass

    def close(self):
        self.closed = True


def fake_run(handle, deadline=float("inf")):
    said = []
    hp = SimpleNamespace(peak_tflops=None, metrics_path="m.jsonl", slurm_reserve_s=0.0)
    run = SimpleNamespace(
        hp=hp, device=torch.device("cpu"), world=1, rank=0, metrics=MetricsFile(handle), say=said.append
    )
    run.deadline = deadline
    return run, said


def rows(n):
    return [{"step": i, "elapsed_s": i / 10, "train_loss": 5.0 - i / 100} for i in range(n)]


def test_a_metrics_file_that_blocks_never_holds_emit_and_every_row_lands_in_order():
    handle = BlockingFile()
    run, said = fake_run(handle)
    log = Logger(run, SimpleNamespace(budget_s=60.0))
    emitted = threading.Thread(target=lambda: [log.emit(row) for row in rows(200)], daemon=True)
    start = time.perf_counter()
    emitted.start()
    emitted.join(10.0)
    assert not emitted.is_alive(), "emit waited for the blocked file"
    assert time.perf_counter() - start < 5.0 and handle.parts == []  # the writer is stuck; the loop is not
    handle.gate.set()
    assert run.metrics.close(10.0) and handle.closed
    lines = "".join(handle.parts).splitlines()
    assert [json.loads(line) for line in lines] == rows(200) and said == []


def test_a_writer_stuck_at_the_end_is_said_and_left_behind_after_the_bound(monkeypatch):
    monkeypatch.setattr(report, "METRICS_DRAIN_S", 0.5)
    handle = BlockingFile()
    run, said = fake_run(handle)
    run.metrics.put(rows(1)[0])
    start = time.perf_counter()
    close_metrics(run)
    assert 0.4 < time.perf_counter() - start < 5.0
    assert run.metrics is None and len(said) == 1 and "took no rows for 0 s" in said[0] and "dropped" in said[0]
    assert not handle.closed  # never closed under a write in flight
    handle.gate.set()


def test_under_slurm_the_end_waits_at_most_half_of_what_is_left_of_the_job():
    handle = BlockingFile()
    run, said = fake_run(handle, deadline=time.time() + 1.0)  # the job ends in 1 s (no reserve): wait 0.5 s, not 30
    run.metrics.put(rows(1)[0])
    start = time.perf_counter()
    close_metrics(run)
    assert time.perf_counter() - start < 3.0 and len(said) == 1
    handle.gate.set()


def test_a_full_disk_is_said_once_and_rows_after_it_are_dropped_without_stalling():
    run, said = fake_run(open("/dev/full", "w"))
    log = Logger(run, SimpleNamespace(budget_s=60.0))
    for row in rows(50):
        log.emit(row)
        time.sleep(0.002)  # the writer meets the full disk while rows still come
    deadline = time.perf_counter() + 10.0
    while run.metrics.error is None and time.perf_counter() < deadline:
        time.sleep(0.01)
    for row in rows(50):
        log.emit(row)
    close_metrics(run)
    assert len(said) == 1 and said[0].startswith("warning: cannot write m.jsonl (No space left on device)")

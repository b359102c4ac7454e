"""report.py's metrics file: rows queued by the loop and written by a thread of their own, so a stalled file system
(NFS at the event) never holds the training loop; every row lands, in order, and a writer stuck at the end is left
behind after a bound."""

import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch

import report
from conftest import LONG_BUDGET, ROOT, TINY, on_tokens, read_metrics, run_train
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
    monkeypatch.setattr(report, "METRICS_DRAIN_MIN_S", 0.2)
    handle = BlockingFile()
    run, said = fake_run(handle)
    run.metrics.put(rows(1)[0])
    start = time.perf_counter()
    close_metrics(run)
    assert 0.4 < time.perf_counter() - start < 5.0
    assert run.metrics.closed and len(said) == 1 and "took no rows for 0 s" in said[0] and "dropped" in said[0]
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


def test_a_run_past_its_jobs_end_still_gives_a_slow_writer_its_last_rows():
    """A job that trained up to its wall and saved past it (a slow save): the writer still gets a second for the
    last rows, and takes them (a join of 0 s dropped them whenever the thread had not yet run)."""
    handle = BlockingFile()
    run, said = fake_run(handle, deadline=time.time() - 5.0)
    run.metrics.put(rows(1)[0])
    threading.Timer(0.3, handle.gate.set).start()  # a write that takes 0.3 s
    close_metrics(run)
    assert said == [] and handle.closed and [json.loads(line) for line in "".join(handle.parts).splitlines()] == rows(1)


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


# ----------------------------------------------------------------------------- --profile


def test_a_profiled_window_counts_its_overhead_and_the_export_as_paused(tmp_path):
    """The clock measures steps without the profiler's cost: each profiled step's time beyond the clock's forecast,
    and the export, are paused time; steps outside the window cost nothing."""
    said = []
    hp = SimpleNamespace(metrics_path=str(tmp_path / "metrics.jsonl"))
    run = SimpleNamespace(hp=hp, device=torch.device("cpu"), say=said.append)
    profile = report.StepProfile(run, SimpleNamespace(step_s=0.01))
    paused = 0.0
    for step in range(8):
        profile.begin(step)
        if report.PROFILE_FROM <= step:
            time.sleep(0.05)  # a profiled step 0.04 s slower than the forecast
        torch.ones(8) @ torch.ones(8)
        paused += profile.end(step + 1)
        if step < report.PROFILE_FROM:
            assert paused == 0.0 and profile.profiler is None
    assert profile.close(8) == 0.0  # after the window closed itself: nothing more
    assert paused >= 3 * 0.04 and len(said) == 1
    assert said[0].startswith(
        f"profile: steps 3-5 in {tmp_path / 'metrics.trace.json'} (open it in https://ui.perfetto"
    )
    events = json.loads((tmp_path / "metrics.trace.json").read_text())["traceEvents"]
    assert {"step 3", "step 4", "step 5", "aten::dot"} <= {e.get("name") for e in events}
    assert "step 6" not in {e.get("name") for e in events}


def test_profile_writes_a_trace_of_the_steps_ops_and_says_the_top_ones(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, "--max_steps", "7", *LONG_BUDGET, "--log_every_s", "0", "--profile"]
    proc, _ = run_train(args, tmp_path)
    trace = json.loads((tmp_path / "metrics.trace.json").read_text())  # what Perfetto and chrome://tracing open
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert {"step 3", "step 4", "step 5"} <= names and "step 2" not in names and "step 6" not in names
    assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= names  # the forward's
    assert any(name.startswith("autograd::engine::evaluate_function") for name in names)  # the backward's
    assert any(name.startswith("Optimizer.step#") for name in names)  # the optimizers'
    assert "profile: steps 3-5 in" in proc.stdout and "Self CPU" in proc.stdout  # the top-ops table
    summary = subprocess.run(
        [sys.executable, str(ROOT / "bench/profile_summary.py"), str(tmp_path / "metrics.trace.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )  # what bench/gpu_check.sh reports from it: each step's times, the compiled graphs' attention (none: eager)
    assert summary.returncode == 0 and "| step 4 |" in summary.stdout and "no CUDA activity |" in summary.stdout
    assert "| (no compiled graph: an eager run) | | |" in summary.stdout
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 7

"""A log stream that goes away, fills or blocks (a killed tee, a closed stdout, a dropped ssh session, a full disk, a
full non-blocking pipe) never ends or stalls a run: the writes are dropped (counted where they would block), said once
on the other stream and in the summary's lost_streams, and the run saves and validates as it would have; the SLURM
scripts' own log lines never end the job. Whole runs are small subprocesses on 2 CPU cores, in the slow tier."""

import errno
import fcntl
import io
import os
import signal
import subprocess
import sys
import time

import pytest

import streams
from conftest import ROOT, TINY, child_env, command, first_row, on_tokens, read_metrics
from eval import load_checkpoint


# ----------------------------------------------------------------------------- a stream that goes away


def test_a_stream_whose_reader_went_away_is_dropped_once_and_said_on_the_other(capsys):
    import streams

    read, write = os.pipe()
    os.close(read)
    lost = []
    out = streams.LogStream(os.fdopen(write, "w"), "stdout", write, lost)
    assert out.write("x" * 100_000) == 100_000  # larger than the pipe buffer: the write itself fails
    out.flush()
    assert out.write("more") == 4 and out.lost == "broken pipe" and lost == ["stdout (broken pipe)"]
    closed = streams.LogStream(open(os.devnull, "w"), "stderr", 2, lost)
    closed.stream.close()
    closed.write("after close")
    assert lost[-1] == "stderr (closed)"
    full = streams.LogStream(open("/dev/full", "w"), "stdout", os.open(os.devnull, os.O_WRONLY), lost)
    full.write("y")
    full.flush()
    assert lost[-1] == "stdout (no space left on device)"


def test_an_error_that_is_not_a_lost_stream_is_still_raised():
    import streams

    class Refusing:
        def write(self, text):
            raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        streams.LogStream(Refusing(), "stdout", 1, []).write("x")


def stopped_run(tmp_path, token_dir, wire, stop=signal.SIGTERM, extra=()):
    """A run whose output wire(cmd) sets up; once it trains, wire's killer runs and then stop reaches the trainer.
    Returns (trainer exit code, metrics, checkpoint, the trainer's stderr if wire kept one)."""
    args = [*on_tokens(token_dir), *TINY, "--time_limit_min", "10", "--log_every_s", "0.2", *extra]
    proc, kill_reader = wire(command(args, 1))
    try:
        first_row(proc, tmp_path / "metrics.jsonl")
        kill_reader()
        time.sleep(1.5)  # progress-bar and note writes meet the dead stream first
        proc.send_signal(stop)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    rows, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    return rc, rows, val, summary, ckpt


def assert_saved_and_validated(rc, rows, val, summary, ckpt):
    assert rc == 0
    assert summary["stop_reason"] == "signal" and summary["steps"] > 0
    assert ckpt["step"] == summary["steps"]  # the last whole step, not step 0 or a periodic save
    assert val and val[-1]["step"] == summary["steps"] and summary["val_loss"] == val[-1]["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_run_piped_to_tee_survives_tee_being_killed_with_it(tmp_path, token_dir, stop):
    # `python train.py ... 2>&1 | tee run.log`: scancel or Ctrl-C reaches tee too
    def wire(cmd):
        tee = subprocess.Popen(["tee", str(tmp_path / "run.log")], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=tee.stdin, stderr=subprocess.STDOUT)
        tee.stdin.close()
        return proc, lambda: (tee.send_signal(signal.SIGTERM), tee.wait())

    rc, rows, val, summary, ckpt = stopped_run(tmp_path, token_dir, wire, stop)
    assert_saved_and_validated(rc, rows, val, summary, ckpt)
    assert "stdout (broken pipe)" in summary["lost_streams"]


@pytest.mark.slow
def test_a_run_with_stdout_closed_and_stderr_gone_at_a_hangup_saves(tmp_path, token_dir):
    # the launcher closed stdout (`>&-`); stderr's reader then goes away (an ssh session dropped) and SIGHUP arrives
    def wire(cmd):
        proc = subprocess.Popen(
            ["bash", "-c", 'exec "$@" >&-', "bash", *cmd], cwd=tmp_path, env=child_env(), stderr=subprocess.PIPE
        )
        return proc, proc.stderr.close

    rc, rows, val, summary, ckpt = stopped_run(tmp_path, token_dir, wire, signal.SIGHUP)
    assert_saved_and_validated(rc, rows, val, summary, ckpt)
    assert summary["lost_streams"] == ["stdout (closed at start)", "stderr (broken pipe)"]


@pytest.mark.slow
def test_a_log_on_a_full_disk_is_dropped_and_the_run_finishes(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, "--max_steps", "6", "--time_limit_min", "10"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            command(args, 1), cwd=tmp_path, env=child_env(), stdout=full, stderr=subprocess.PIPE, text=True, timeout=300
        )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "stdout went away (no space left on device)" in proc.stderr
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 6 and summary["lost_streams"] == ["stdout (no space left on device)"]


# ----------------------------------------------------------------------------- a stream that blocks


def full_pipe():
    """(read end, write end) of a one-page pipe, its write end non-blocking (as a launcher may leave a log stream)
    and full: no reader takes anything until the test drains it."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETFL, fcntl.fcntl(write, fcntl.F_GETFL) | os.O_NONBLOCK)
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    while True:
        try:
            os.write(write, b"." * 512)
        except BlockingIOError:
            return read, write


def drain(fd):
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    taken = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            taken += chunk
    except BlockingIOError:
        pass
    return taken


TEXT_LAYERS = {  # Python's own stdout: block-buffered, or with PYTHONUNBUFFERED / -u a raw descriptor under the text
    "buffered": lambda fd: os.fdopen(fd, "w", closefd=False),
    "unbuffered": lambda fd: io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True),
}


@pytest.mark.parametrize("layer", TEXT_LAYERS.values(), ids=TEXT_LAYERS.keys())
def test_a_write_that_would_block_is_dropped_counted_and_the_stream_stays(monkeypatch, layer):
    read, write = full_pipe()
    try:
        out = streams.LogStream(layer(write), "stdout", write, [])
        assert out.write("x" * 300) == 300 and out.dropped == 300 and out.lost is None
        out.flush()  # nothing kept back for a later flush (or Python's at exit) to fail on
        assert len(drain(read)) == 4096  # the filler only
        assert out.write("y" * 5000) == 5000  # more than the page: part is written, the rest dropped
        written = drain(read)
        assert set(written) <= {ord("y")} and out.dropped == 300 + 5000 - len(written) and len(written) >= 4096 - 512
        out.write("z\n")
        assert drain(read) == b"z\n" and out.dropped == 5300 - len(written)  # a reader that caught up gets it all
        monkeypatch.setattr(sys, "stdout", out)
        assert f"stdout ({out.dropped:,} bytes dropped: would block)" in streams.lost_log_streams()
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.slow
def test_a_run_whose_log_pipe_is_non_blocking_and_full_trains_saves_and_says_what_it_dropped(tmp_path):
    read, write = full_pipe()
    env = {k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"}  # buffered, as most runs are
    args = [*TINY, "--max_steps", "6", "--time_limit_min", "10"]
    try:
        proc = subprocess.run(command(args, 1), cwd=tmp_path, env=env, stdout=write, stderr=write, timeout=300)
        assert len(drain(read)) == 4096  # nothing got through, and nothing waited for the reader
    finally:
        os.close(read)
        os.close(write)
    assert proc.returncode == 0  # not 120: Python's flush at exit has nothing left to fail on
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 6 and val[-1]["step"] == 6
    assert load_checkpoint(tmp_path / "checkpoint.pt")[1]["step"] == 6
    dropped = [entry for entry in summary["lost_streams"] if entry.endswith("bytes dropped: would block)")]
    assert [entry.split()[0] for entry in dropped] == ["stdout", "stderr"], summary["lost_streams"]


# ----------------------------------------------------------------------------- the SLURM scripts' own log lines


def test_the_slurm_node_wrapper_reports_torchrun_and_keeps_its_exit_code_when_stdout_is_gone(tmp_path):
    script = (ROOT / "submit_slurm.sh").read_text()
    wrapper = script.split("bash -c '", 1)[1].split("' node", 1)[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\nexit 3\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    read, write = os.pipe()
    os.close(read)  # the job log's reader is gone
    try:
        broken = subprocess.run(["bash", "-c", wrapper, "node"], env=env, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert broken.returncode == 3 and b"torchrun exited 3" in broken.stderr  # said on stderr, not killed by SIGPIPE
    ok = subprocess.run(["bash", "-c", wrapper, "node"], env=env, capture_output=True, text=True)
    assert ok.returncode == 3 and "torchrun exited 3" in ok.stdout and not ok.stderr


def test_the_slurm_batch_script_lines_never_end_the_job_on_a_lost_log():
    script = (ROOT / "submit_slurm.sh").read_text()
    for line in script.splitlines():  # every log line goes through say() or say_err(), which cannot fail
        assert not line.strip().startswith("echo ") and "|| echo" not in line.split("#")[0] or "$line" in line, line
    say = "; ".join(line for line in script.splitlines() if line.startswith(("say()", "say_err()")))
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            ["bash", "-c", f"set -euo pipefail; {say}; say hello; echo survived >&2"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == "hello\nsurvived\n"

"""The third fault round (issue 36), class by class: a log stream that goes away, an output or a staged copy that
reaches an input by another path, checks after the first write, a tight cap, many data files,
the data CLI and the small ones. Every run is a small subprocess on 2 CPU cores."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, child_env, command, first_row, on_tokens, read_metrics
from eval import load_checkpoint

# ----------------------------------------------------------------------------- 1. a log stream that goes away


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


# ----------------------------------------------------------------------------- 2. stage.py never writes to its source

PLAN = json.dumps({"tokens": 20_000, "world_size": 1})


@pytest.fixture
def stage_src(tmp_path, monkeypatch):
    import numpy as np

    import stage

    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (np.arange(i, i + 300_000) % 1000 + 2).astype("<u2").tofile(src / f"chunk_{i + 1:04d}.bin")
    monkeypatch.setattr(stage.socket, "getfqdn", lambda: "n1")
    return src


def run_stage(src, dst, *flags, plan=PLAN):
    import stage

    argv = [str(src), str(dst), "--plan", plan, "--nodes", "n1", "--nproc", "1", *flags]
    try:
        stage.main([*argv, "--", "--seq_len", "15", "--val_tokens", "1000"])
    except SystemExit as e:
        return e.code
    return 0


def same_dir(tmp, src):
    return src


def symlinked_dir(tmp, src):
    (tmp / "local").symlink_to(src)
    return tmp / "local"


def linked_chunks(make_link):
    def make(tmp, src):
        (tmp / "local").mkdir()
        for chunk in src.iterdir():
            make_link(chunk, tmp / "local" / chunk.name)
        return tmp / "local"

    return make


def a_file(tmp, src):
    (tmp / "local").write_text("not a folder")
    return tmp / "local"


STAGE_DESTINATIONS = {
    "the source folder": (same_dir, "is the source folder"),
    "a symlink to the source folder": (symlinked_dir, "is the source folder"),
    "a folder of hard links to the chunks": (linked_chunks(os.link), "is the source file"),
    "a folder of symlinks to the chunks": (linked_chunks(os.symlink), "is the source file"),
    "a file": (a_file, "is a file, not a folder"),
}


@pytest.mark.parametrize("case", STAGE_DESTINATIONS.values(), ids=STAGE_DESTINATIONS.keys())
def test_staging_never_writes_through_to_its_source(tmp_path, stage_src, capsys, case):
    make, words = case
    before = {p.name: p.read_bytes() for p in stage_src.iterdir()}
    assert run_stage(stage_src, make(tmp_path, stage_src)) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in stage_src.iterdir()} == before


def test_a_bind_mount_of_the_source_is_the_source(tmp_path, stage_src, capsys):
    (tmp_path / "bound").mkdir()
    if subprocess.run(["mount", "--bind", str(stage_src), str(tmp_path / "bound")], capture_output=True).returncode:
        pytest.skip("no bind mounts here (not root)")
    try:
        before = {p.name: p.read_bytes() for p in stage_src.iterdir()}
        assert run_stage(stage_src, tmp_path / "bound") == 2
        assert "is the source folder" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in stage_src.iterdir()} == before
    finally:
        subprocess.run(["umount", str(tmp_path / "bound")])


STAGE_FLAGS = {
    "plan not JSON": ({"plan": "plan: l2w64 ..."}, "--plan"),
    "plan without tokens": ({"plan": json.dumps({"world_size": 1})}, "--plan"),
    "plan with negative tokens": ({"plan": json.dumps({"tokens": -5, "world_size": 1})}, "--plan"),
    "plan a list": ({"plan": "[1, 2]"}, "--plan"),
    "margin nan": ({"flags": ["--margin", "nan"]}, "--margin"),
    "margin inf": ({"flags": ["--margin", "inf"]}, "--margin"),
    "margin 0": ({"flags": ["--margin", "0"]}, "--margin"),
    "nproc 0": ({"flags": ["--nproc", "0"]}, "--nproc"),
}


@pytest.mark.parametrize("case", STAGE_FLAGS.values(), ids=STAGE_FLAGS.keys())
def test_stage_bad_inputs_are_one_sentence_and_exit_2(tmp_path, stage_src, capsys, case):
    given, words = case
    code = run_stage(stage_src, tmp_path / "dst", *given.get("flags", []), plan=given.get("plan", PLAN))
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def test_staging_replaces_stale_files_and_leaves_no_temporary_one(tmp_path, stage_src, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "chunk_0001.bin").write_bytes(b"stale")
    (dst / ".chunk_0002.bin.staging").write_bytes(b"left by a killed copy")
    assert run_stage(stage_src, dst) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["chunk_0001.bin", "chunk_0002.bin", "staged.json"]
    assert (dst / "chunk_0001.bin").stat().st_size == (stage_src / "chunk_0001.bin").stat().st_size


# ----------------------------------------------------------------------------- 3. an output that reaches an input


@pytest.fixture
def hp_on(tmp_path, token_dir):
    """Hyperparameters resolved as a run on a copy of token_dir writing into tmp_path would have them: (hp, data)."""
    import shutil

    import config

    data = tmp_path / "data"
    shutil.copytree(token_dir, data)
    hp, _, _ = config.parse_args(["--data_dir", str(data), "--checkpoint_path", str(tmp_path / "ck.pt")])
    return config.resolve(hp, 1), data


def hard_link(tmp, target, name="out.pt"):
    os.link(target, tmp / name)
    return str(tmp / name)


IDENTITY_CASES = {
    "metrics hard-linked to a chunk": (lambda tmp, d: {"metrics_path": hard_link(tmp, d / "chunk_0001.bin")}, "input"),
    "checkpoint hard-linked to a chunk": (
        lambda tmp, d: {"checkpoint_path": hard_link(tmp, d / "chunk_0002.bin")},
        "input",
    ),
    "val_file hard-linked to the checkpoint": (
        lambda tmp, d: {"val_file": hard_link(tmp, (tmp / "ck.pt").write_bytes(b"x") and tmp / "ck.pt", "v.bin")},
        "input",
    ),
    "metrics hard-linked to the checkpoint": (
        lambda tmp, d: {"metrics_path": hard_link(tmp, (tmp / "ck.pt").write_bytes(b"x") and tmp / "ck.pt", "m")},
        "each needs its own",
    ),
}


@pytest.mark.parametrize("case", IDENTITY_CASES.values(), ids=IDENTITY_CASES.keys())
def test_an_output_reaching_an_input_by_a_hard_link_is_refused(hp_on, tmp_path, case):
    import dataclasses

    import paths

    hp, data = hp_on
    make, words = case
    hp = dataclasses.replace(hp, **make(tmp_path, data))
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    with pytest.raises(ValueError, match=words):
        paths.check_outputs(hp, print)
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_a_checkpoint_through_a_bind_mount_of_the_data_is_refused(hp_on, tmp_path):
    import dataclasses

    import paths

    hp, data = hp_on
    (tmp_path / "bound").mkdir()
    if subprocess.run(["mount", "--bind", str(data), str(tmp_path / "bound")], capture_output=True).returncode:
        pytest.skip("no bind mounts here (not root)")
    try:
        for flag in ("checkpoint_path", "metrics_path"):
            with pytest.raises(ValueError, match="is the input file"):
                paths.check_outputs(
                    dataclasses.replace(hp, **{flag: str(tmp_path / "bound" / "chunk_0001.bin")}), print
                )
    finally:
        subprocess.run(["umount", str(tmp_path / "bound")])


@pytest.mark.slow
def test_a_metrics_file_hard_linked_to_a_chunk_is_refused_end_to_end(tmp_path, token_dir):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(token_dir, data)
    before = (data / "chunk_0001.bin").read_bytes()
    os.link(data / "chunk_0001.bin", tmp_path / "metrics.jsonl")
    args = [*on_tokens(data), *TINY, "--max_steps", "2"]
    proc = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "would destroy it" in proc.stderr and "Traceback" not in proc.stderr
    assert (data / "chunk_0001.bin").read_bytes() == before and not (tmp_path / "checkpoint.pt").exists()


METRICS_ROW = {"step": 1, "elapsed_s": 0.5, "lr_frac": 1.0, "train_loss": 9.0, "tokens": 1024, "tokens_per_s": 2048}


def test_plot_out_never_overwrites_a_metrics_file_it_reads(tmp_path, capsys):
    import plot

    (tmp_path / "run").mkdir()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(json.dumps(METRICS_ROW) + "\n")
    os.link(metrics, tmp_path / "curves.png")
    for out in (metrics, tmp_path / "curves.png"):
        with pytest.raises(SystemExit) as e:
            plot.main([str(tmp_path / "run"), "--out", str(out)])
        assert e.value.code == 2 and "would destroy it" in capsys.readouterr().err
    assert metrics.read_text() == json.dumps(METRICS_ROW) + "\n"


# ----------------------------------------------------------------------------- 4. every check before the first write


def late_bos_data(folder, files=3, tokens=20_000):
    """Files whose only BOS is 5 tokens from the end: BOS is detected (rate 5e-5), but no window can start at one."""
    import numpy as np

    folder.mkdir()
    for i in range(files):
        ids = (np.arange(tokens) % 900 + 3).astype("<u2")
        ids[-5] = 1
        ids.tofile(folder / f"chunk_{i:04d}.bin")
    return folder


def test_data_in_which_no_window_can_be_formed_fails_when_the_loader_is_made(tmp_path):
    import numpy as np

    from data import BatchLoader, load_token_data
    from shards import Deal
    from windows import WindowSpec

    data = load_token_data(late_bos_data(tmp_path / "data"), 1024, 64, 1000)
    with pytest.raises(ValueError, match="too sparse for --doc_aligned"):
        BatchLoader(data.train, WindowSpec(64, doc_aligned=True, bos_id=data.bos_id), 4, Deal(0, 1))
    bad = [np.full(5000, 700, dtype="<u2")]  # every id >= vocab_size, in arrays the start-up check never sampled
    with pytest.raises(ValueError, match="holds a token id >= vocab_size 500"):
        BatchLoader(bad, WindowSpec(64, vocab_size=500), 4, Deal(0, 1))


@pytest.mark.slow
def test_a_run_in_which_no_window_can_be_formed_keeps_the_existing_checkpoint(tmp_path):
    data = late_bos_data(tmp_path / "data")
    (tmp_path / "checkpoint.pt").write_bytes(b"a good checkpoint of an earlier run")
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--doc_aligned", "--max_steps", "2"]
    proc = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "too sparse for --doc_aligned" in proc.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"a good checkpoint of an earlier run"


# ----------------------------------------------------------------------------- 5. a tight cap


def clock_run(plan, budget_s, max_steps, speed):
    """The clock driven through a run of this plan on a device `speed` x the forecast: (steps, end seconds)."""
    import clock as C

    clock = C.Clock(
        budget_s,
        max_steps,
        plan.grad_accum_steps,
        1.0,
        may_replan=True,
        planned_step_s=plan.step_s,
        min_accum=plan.min_accum,
    )
    unit_s, step, elapsed = plan.step_s / plan.grad_accum_steps / speed, 0, 0.0
    while not (clock.due(step) and clock.sync(step, elapsed, 0.0, 0.0)):
        elapsed += unit_s * clock.begin_step(step)[1]
        step += 1
    return step, elapsed


@pytest.mark.parametrize("budget_s", [60.0, 600.0])
def test_every_cap_plans_steps_inside_the_budget_and_the_clock_keeps_them_under_the_cap(event_plan, budget_s):
    import clock as C

    for max_steps in (1, 2, 3, 5, 10, 20, 44, 45, 60, 500):
        plan = event_plan(model="l16w1024", budget_s=budget_s, max_steps=max_steps)[0]
        assert 1 <= plan.steps <= max(1, C.STEP_HEADROOM * max_steps) and plan.tokens > 0, max_steps
        assert 0 < plan.train_s <= budget_s and not re.search(r"[\s(~]-\d", plan.line()), max_steps
        for speed in (1.0, 2.0):
            steps, end = clock_run(plan, budget_s, max_steps, speed)
            assert steps <= max_steps and end <= budget_s + plan.step_s / speed, (max_steps, speed, end)


# ----------------------------------------------------------------------------- 6. many data files


def many_files(folder, n_files, tokens=5000):
    import numpy as np

    folder.mkdir()
    for i in range(n_files):
        (np.arange(i, i + tokens) % 900 + 3).astype("<u2").tofile(folder / f"chunk_{i:05d}.bin")
    return folder


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_the_reader_holds_a_bounded_number_of_files_open(tmp_path):
    from data import BatchLoader, load_token_data
    from shards import Deal
    from windows import WindowSpec
    from windows import MAX_OPEN_FILES

    data = load_token_data(many_files(tmp_path / "data", 150, tokens=600), 1024, 15, 0)
    before = open_fds()
    with BatchLoader(data.train, WindowSpec(15), 16, Deal(0, 1), prefetch_tokens=0) as loader:
        for _ in range(200):  # 3,200 windows: most of the 150 files' 5,600 blocks-worth are read
            next(loader)
            assert open_fds() - before <= MAX_OPEN_FILES + 2
        assert len(loader.reader._files) == MAX_OPEN_FILES
    assert open_fds() == before


def limited(soft, hard):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_folder_of_more_files_than_the_soft_limit_trains_and_check_agrees(tmp_path):
    data = many_files(tmp_path / "data", 400)
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--max_steps", "2"]
    run = subprocess.run(
        command(args, 1),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited(256, 4096),
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "open-file limit raised from 256 to 720 for 400 files" in run.stdout
    check = subprocess.run(
        [sys.executable, str(ROOT / "data_cli.py"), "check", str(data), "--vocab_size", "1024", "--seq_len", "32"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited(256, 4096),
    )
    assert check.returncode == 0 and "a run here: open-file limit raised from 256 to 720" in check.stdout


@pytest.mark.slow
def test_a_hard_limit_too_low_for_the_files_is_one_sentence_in_the_run_and_in_check(tmp_path):
    data = many_files(tmp_path / "data", 400)
    (tmp_path / "checkpoint.pt").write_bytes(b"an earlier run's")
    args = ["--data_dir", str(data), "--vocab_size", "1024", *TINY, "--max_steps", "2"]
    run = subprocess.run(
        command(args, 1),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited(300, 300),
    )
    check = subprocess.run(
        [sys.executable, str(ROOT / "data_cli.py"), "check", str(data), "--vocab_size", "1024", "--seq_len", "32"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited(300, 300),
    )
    for proc in (run, check):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "the 400 token files need about 720 open files, but this process may open at most 300" in proc.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"an earlier run's"


# ----------------------------------------------------------------------------- 7. the data CLI


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
def test_data_cli_bad_counts_and_targets_are_one_sentence_and_exit_2(tmp_path, token_dir, capsys, case):
    import shutil

    argv, words = case
    data = tmp_path / "data"
    shutil.copytree(token_dir, data)
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    argv = [a.replace("OUT", str(tmp_path / "out")).replace("DATA", str(data)) for a in argv]
    code, err = data_cli_run(argv, capsys)
    assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before and not (tmp_path / "out").exists()


def test_synth_on_a_full_disk_leaves_no_partial_chunk(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        code, err = data_cli_run(["synth", disk / "out", "--tokens", "3e5", "--chunk_tokens", "5e4"], capsys)
        assert code == 2 and "No space left on device" in err and err.count("\n") == 1, err
        written = sorted(p.name for p in (disk / "out").iterdir())
        assert written and all(p.startswith("chunk_") for p in written)  # whole chunks only, no temporary file
        assert all((disk / "out" / p).stat().st_size == 100_000 for p in written)
    finally:
        subprocess.run(["umount", str(disk)])


# ----------------------------------------------------------------------------- 8. small ones


@pytest.mark.parametrize("value", ["soon", "", "nan", "inf", "2025-01-01T10:00:00"])
def test_a_slurm_end_time_that_is_not_a_time_is_one_warning_and_no_deadline(monkeypatch, value):
    import deadline

    monkeypatch.setenv("SLURM_JOB_END_TIME", value)
    said = []
    assert deadline.slurm_end_time(said.append) is None
    assert len(said) == 1 and "is not a time; no SLURM deadline" in said[0]
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 300))
    assert deadline.slurm_end_time(said.append) > time.time() and len(said) == 1


def test_plot_out_without_a_suffix_writes_and_reports_that_name(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import plot

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({**METRICS_ROW, "step": s, "elapsed_s": s / 2}) for s in (1, 2)) + "\n")
    plot.main([str(metrics), "--out", str(tmp_path / "curves")])
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curves'}"
    assert (tmp_path / "curves").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png").exists()


def test_a_micro_batch_that_raises_the_tokens_per_step_says_so(event_plan):
    import dataclasses

    import launch
    import config

    lines = 0
    for overrides in ({"micro_batch": 48}, {"micro_batch": 48, "batch_tokens": 524288}, {"micro_batch": 16}, {}):
        plan, _ = event_plan(**overrides)
        hp, _, _ = config.parse_args(["--dry_run", "--peak_tflops", "2250", "--device_memory_gib", "288"])
        hp = dataclasses.replace(config.resolve(hp, 1), **overrides)
        said = []
        launch.check_plan(plan, hp, 288 * 2**30, 600.0, said.append)
        raised = [line for line in said if line.startswith("--micro_batch")]
        assert plan.tokens_per_step >= plan.asked_tokens_per_step
        assert len(raised) == (plan.tokens_per_step > plan.asked_tokens_per_step and "micro_batch" in overrides), said
        lines += len(raised)
    assert lines >= 2  # 48 x 1,024 x 32 ranks = 1.57M tokens: 2,555,904 asked becomes 3,145,728; 524,288 becomes 1.57M


HELLASWAG_ROWS = {
    "ctx_b null": {"ctx_a": "A man", "ctx_b": None, "endings": ["runs.", "sits."], "label": 0},
    "ctx_b missing": {"ctx_a": "A man", "endings": ["runs.", "sits."], "label": 0},
    "ctx null": {"ctx": None, "endings": ["runs.", "sits."], "label": 0},
    "an ending null": {"ctx": "A man", "endings": ["runs.", None], "label": 0},
    "label null": {"ctx": "A man", "endings": ["runs.", "sits."], "label": None},
    "endings missing": {"ctx": "A man", "label": 0},
}


@pytest.mark.parametrize("row", HELLASWAG_ROWS.values(), ids=HELLASWAG_ROWS.keys())
def test_a_hellaswag_row_missing_a_field_is_one_sentence_naming_the_row(tmp_path, row):
    import eval as E

    good = {"ctx": "A woman", "endings": ["walks.", "talks."], "label": 1}
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"line 2 is not an example") as e:
        E.load_hellaswag(str(path))
    assert "None" not in str(e.value).replace(str(path), "")

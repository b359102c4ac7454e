"""Where a run writes, and what it says it wrote. An output path that would destroy an input (by its name, a
symlink, a hard link or a bind mount) is refused; each output belongs to one running train.py through its lock file,
whatever the storage or the user; a disk that fills under the run keeps the last checkpoint; on every path that ends a
run the checkpoint and the summary label the weights the file holds; a run refused after its checks began leaves
nothing new. Whole runs are small subprocesses on 2 CPU cores, in the slow tier."""

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import pytest
import torch

import paths
from checkpoint import save_checkpoint
from conftest import (
    ROOT,
    TINY,
    bind_mount,
    child_env,
    command,
    first_row,
    on_tokens,
    patched_train,
    read_metrics,
    run_train,
    tmpfs,
)
from eval import load_checkpoint
from model import get_model


# ----------------------------------------------------------------------------- an output that would destroy an input


@pytest.fixture
def hp_on(tmp_path, token_copy):
    """Hyperparameters resolved as a run on a copy of token_dir writing into tmp_path would have them: (hp, data)."""
    import config

    hp, _, _ = config.parse_args(["--data_dir", str(token_copy), "--checkpoint_path", str(tmp_path / "ck.pt")])
    return config.resolve(hp, 1), token_copy


OUTPUT_CASES = {
    "checkpoint is a data chunk": (lambda hp, tmp, data: {"checkpoint_path": str(data / "chunk_0001.bin")}, "input"),
    "metrics is a data chunk": (lambda hp, tmp, data: {"metrics_path": str(data / "chunk_0002.bin")}, "input"),
    "checkpoint links to a chunk": (
        lambda hp, tmp, data: {"checkpoint_path": link(tmp, data / "chunk_0001.bin")},
        "input",
    ),
    "metrics equals checkpoint": (lambda hp, tmp, data: {"metrics_path": hp.checkpoint_path}, "each needs its own"),
    "checkpoint is a FIFO": (lambda hp, tmp, data: {"checkpoint_path": fifo(tmp)}, "pipe"),
    "checkpoint is a device": (lambda hp, tmp, data: {"checkpoint_path": "/dev/null"}, "device"),
    "checkpoint is empty": (lambda hp, tmp, data: {"checkpoint_path": ""}, "empty"),
    "metrics is blank": (lambda hp, tmp, data: {"metrics_path": "  "}, "empty"),
    "checkpoint is a folder": (lambda hp, tmp, data: {"checkpoint_path": str(tmp)}, "folder"),
    "val_file is the checkpoint": (lambda hp, tmp, data: {"val_file": hp.checkpoint_path}, "input"),
}


def link(tmp, target):
    (tmp / "link.pt").symlink_to(target)
    return str(tmp / "link.pt")


def fifo(tmp):
    os.mkfifo(tmp / "pipe.pt")
    return str(tmp / "pipe.pt")


@pytest.mark.parametrize("case", OUTPUT_CASES.values(), ids=OUTPUT_CASES.keys())
def test_an_output_path_never_destroys_an_input_or_lands_somewhere_unexpected(hp_on, tmp_path, case):
    import dataclasses

    import paths

    hp, data = hp_on
    make, words = case
    hp = dataclasses.replace(hp, **make(hp, tmp_path, data))
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    with pytest.raises(ValueError, match=words):
        paths.check_outputs(hp, print)
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_a_symlinked_checkpoint_writes_its_target_and_says_so(hp_on, tmp_path):
    import dataclasses

    import paths

    hp, _ = hp_on
    (tmp_path / "runs").mkdir()
    (tmp_path / "latest.pt").symlink_to(tmp_path / "runs" / "ck.pt")
    said = []
    hp = paths.check_outputs(dataclasses.replace(hp, checkpoint_path=str(tmp_path / "latest.pt")), said.append)
    assert hp.checkpoint_path == str(tmp_path / "runs" / "ck.pt") and "symlink" in said[0]


@pytest.mark.slow
def test_checkpoint_path_naming_a_chunk_is_refused_end_to_end_and_the_chunk_is_kept(tmp_path, token_dir):
    chunk = token_dir / "chunk_0001.bin"
    before = chunk.read_bytes()
    proc, _ = run_train([*on_tokens(token_dir), *TINY, "--checkpoint_path", str(chunk)], tmp_path, expect_rc=2)
    assert "would destroy it" in proc.stderr and "Traceback" not in proc.stderr
    assert chunk.read_bytes() == before


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
    with bind_mount(data, tmp_path / "bound") as bound:
        for flag in ("checkpoint_path", "metrics_path"):
            with pytest.raises(ValueError, match="is the input file"):
                paths.check_outputs(dataclasses.replace(hp, **{flag: str(bound / "chunk_0001.bin")}), print)


def test_two_paths_to_one_output_through_a_bind_mount_are_one_output(tmp_path):
    """Neither file exists yet, and the paths differ even when resolved: their place (the folder's identity and the
    name) is the same, so the run is refused for naming one file twice, not for a run that is not there."""
    (tmp_path / "run").mkdir()
    with bind_mount(tmp_path / "run", tmp_path / "bind"):
        hp = types.SimpleNamespace(
            data_dir=None,
            val_file=None,
            checkpoint_path=str(tmp_path / "run" / "x"),
            metrics_path=str(tmp_path / "bind" / "x"),
        )
        with pytest.raises(ValueError, match="--metrics_path and --checkpoint_path are both"):
            paths.check_outputs(hp, print)


@pytest.mark.slow
def test_a_metrics_file_hard_linked_to_a_chunk_is_refused_end_to_end(tmp_path, token_copy):
    data = token_copy
    before = (data / "chunk_0001.bin").read_bytes()
    os.link(data / "chunk_0001.bin", tmp_path / "metrics.jsonl")
    args = [*on_tokens(data), *TINY, "--max_steps", "2"]
    proc = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "would destroy it" in proc.stderr and "Traceback" not in proc.stderr
    assert (data / "chunk_0001.bin").read_bytes() == before and not (tmp_path / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_rerun_never_writes_through_a_hard_link_a_snapshot_of_its_folder_holds(tmp_path):
    """`cp -al run snap` of a finished run, then a run again in run: the snapshot's files keep their content."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "checkpoint.pt"):
        (run_dir / name).write_text(f"the {name} of an earlier run\n")
    subprocess.run(["cp", "-al", str(run_dir), str(tmp_path / "snap")], check=True)
    run_train([*TINY, "--max_steps", "2", "--save_every_min", "0"], run_dir)
    for name in ("metrics.jsonl", "checkpoint.pt"):
        assert (tmp_path / "snap" / name).read_text() == f"the {name} of an earlier run\n"
    assert read_metrics(run_dir / "metrics.jsonl")[2]["steps"] == 2


# ----------------------------------------------------------------------------- one run to an output: the locks


@pytest.fixture
def own_locks(monkeypatch):
    """paths' module state for this test alone, released after it (a run holds its locks until it exits)."""
    held = []
    monkeypatch.setattr(paths, "OUTPUT_LOCKS", held)
    monkeypatch.setattr(paths, "OUTPUT_FOLDERS", [], raising=False)
    yield held
    for lock in held:
        lock.close()


def outputs(checkpoint_path, metrics_path):
    return types.SimpleNamespace(checkpoint_path=str(checkpoint_path), metrics_path=str(metrics_path))


def test_every_output_is_owned_by_one_run_and_the_advice_points_at_no_clash(tmp_path, own_locks):
    paths.lock_outputs(outputs(tmp_path / "ck.pt", tmp_path / "m.jsonl"), print).close()
    save_checkpoint({"model": {}, "step": 1}, str(tmp_path / "ck.pt"))  # renamed over: the lock must outlive it
    with pytest.raises(ValueError) as refused:
        paths.lock_outputs(outputs(tmp_path / "ck.pt", tmp_path / "other.jsonl"), print)
    assert str(refused.value) == (
        f"--checkpoint_path {tmp_path / 'ck.pt'} is in use by another running train.py; wait for it to end, or give "
        f"this run its own --checkpoint_path and --metrics_path"
    )
    assert not (tmp_path / "other.jsonl").exists()  # refused before anything was written
    clashes = {  # the same metrics, or one run's output as the other's other output
        "metrics_path": [("ck2.pt", "m.jsonl"), ("ck2.pt", "ck.pt")],
        "checkpoint_path": [("m.jsonl", "m2.jsonl")],
    }
    for flag, pairs in clashes.items():
        for checkpoint, metrics in pairs:
            with pytest.raises(ValueError, match=f"--{flag} .* is in use by another running train.py"):
                paths.lock_outputs(outputs(tmp_path / checkpoint, tmp_path / metrics), print)
    assert paths.lock_file(str(tmp_path / "ck.pt")) == str(tmp_path / ".ck.pt.lock")
    for handle in own_locks:  # the first run ends: its paths are free again, the lock files left beside them
        handle.close()
    paths.lock_outputs(outputs(tmp_path / "ck.pt", tmp_path / "other.jsonl"), print).close()


@pytest.mark.slow
def test_a_second_run_on_the_same_checkpoint_with_another_metrics_path_is_refused_before_writing(tmp_path):
    args = [*TINY, "--val_tokens", "8192", "--time_limit_min", "10"]
    first = subprocess.Popen(
        command(args, 1), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(first, tmp_path / "metrics.jsonl")
        second = subprocess.run(
            command([*args, "--metrics_path", "second.jsonl", "--max_steps", "2"], 1),
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr[-2000:]
    assert "--checkpoint_path checkpoint.pt is in use by another running train.py" in second.stderr
    assert not (tmp_path / "second.jsonl").exists()
    assert first.returncode == 0
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"] > 0 and Path(ckpt["config"]["metrics_path"]).name == "metrics.jsonl"


def test_a_second_run_refused_on_a_metrics_file_in_use_leaves_no_lock_file_of_its_own(tmp_path, own_locks):
    paths.lock_outputs(outputs(tmp_path / "ck.pt", tmp_path / "m.jsonl"), print).close()
    with pytest.raises(ValueError, match="--metrics_path .* is in use"):
        paths.lock_outputs(outputs(tmp_path / "ck2.pt", tmp_path / "m.jsonl"), print)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.pt.lock", ".m.jsonl.lock"]


@pytest.mark.parametrize("code", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_storage_that_refuses_locks_is_not_a_path_in_use(tmp_path, monkeypatch, code):
    import errno

    import paths

    def refuse(handle, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    said = []
    hp = outputs(tmp_path / "ck.pt", tmp_path / "metrics.jsonl")
    monkeypatch.setattr(paths.fcntl, "flock", refuse)
    paths.lock_outputs(hp, said.append).close()
    assert len(said) == 1 and "cannot be locked" in said[0]  # one warning for both outputs
    assert sorted(os.listdir(tmp_path)) == []  # no lock to hold, so no lock file made for one
    monkeypatch.setattr(paths.fcntl, "flock", lambda h, op: (_ for _ in ()).throw(BlockingIOError(errno.EAGAIN, "")))
    with pytest.raises(ValueError, match="in use by another running train.py"):
        paths.lock_outputs(hp, said.append)


def test_two_outputs_whose_names_share_a_long_prefix_have_two_locks(tmp_path, own_locks):
    """Names that fit the file system but whose lock names (6 bytes longer) must be cut: the cut part differs."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    stem = "r" * (limit - 6)
    first, second = tmp_path / f"{stem}-a.pt", tmp_path / f"{stem}-b.pt"
    assert paths.lock_file(str(first)) != paths.lock_file(str(second))
    assert all(len(os.path.basename(paths.lock_file(str(p))).encode()) <= limit for p in (first, second))
    paths.lock_outputs(outputs(first, second), print).close()  # one run, two outputs: never refused by itself
    with pytest.raises(ValueError, match="is in use by another running train.py"):  # a second run still is
        paths.lock_outputs(outputs(first, tmp_path / "other.jsonl"), print)


def test_a_lock_path_that_is_not_a_regular_file_is_one_sentence_at_once(tmp_path, own_locks):
    """A FIFO where a lock file goes: opening it to write would wait for a reader forever (SIGTERM included), before
    any message; a folder there is refused as well. Locked on a thread, so a hang fails the test (its FIFO then opened
    to read, which lets the writer go) instead of holding it."""
    for name, make in ((".ck.pt.lock", os.mkfifo), (".m.jsonl.lock", os.mkdir)):
        folder = tmp_path / name.strip(".")
        folder.mkdir()
        make(folder / name)
        said = []

        def lock():
            try:
                paths.lock_outputs(outputs(folder / "ck.pt", folder / "m.jsonl"), print)
            except (ValueError, OSError) as e:
                said.append(str(e))

        locking = threading.Thread(target=lock, daemon=True)
        locking.start()
        locking.join(10)
        if locking.is_alive():
            os.close(os.open(folder / name, os.O_RDONLY | os.O_NONBLOCK))
            pytest.fail(f"opening the lock file {folder / name} blocked")
        flag = "checkpoint" if name.startswith(".ck") else "metrics"
        assert said == [
            f"--{flag}_path {folder / name[1:-5]}: its lock file {folder / name} is not a regular file; remove it, "
            f"or name another output"
        ]
        assert sorted(p.name for p in folder.iterdir()) == [name]  # nothing else made, the other lock removed


def test_a_lock_file_shared_by_a_hard_link_is_replaced_by_one_of_its_own(tmp_path, own_locks):
    """`cp -al` of a running run's folder links its lock files too: a run on the copy is refused while the first
    runs, saying why; once that ends, the copy's run takes a lock file of its own, so a rerun in the first folder is
    not held up by it."""
    (tmp_path / "run").mkdir()
    paths.lock_outputs(outputs(tmp_path / "run" / "ck.pt", tmp_path / "run" / "m.jsonl"), print).close()
    subprocess.run(["cp", "-al", str(tmp_path / "run"), str(tmp_path / "copy")], check=True)
    on_copy = outputs(tmp_path / "copy" / "ck.pt", tmp_path / "copy" / "m.jsonl")
    with pytest.raises(ValueError, match=r"or its lock file .*copy/\.ck\.pt\.lock is one of 2 names of one file"):
        paths.lock_outputs(on_copy, print)
    for lock in own_locks:  # the first run ends
        lock.close()
    own_locks.clear()
    paths.lock_outputs(on_copy, print).close()
    assert (
        os.stat(tmp_path / "copy" / ".ck.pt.lock").st_nlink == os.stat(tmp_path / "run" / ".ck.pt.lock").st_nlink == 1
    )
    paths.lock_outputs(outputs(tmp_path / "run" / "ck.pt", tmp_path / "run" / "m.jsonl"), print).close()


def as_nobody(code, folder):
    """Run Python code as the user nobody (a second user on a machine where tests run as root)."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody here")
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a child as another user")
    prelude = f"import os, sys, types; sys.path.insert(0, {str(ROOT)!r}); import paths\n"  # imported as root
    prelude += f"os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60, cwd=folder
    )


@pytest.fixture
def shared_folder():
    """A folder every user may write in (a shared scratch space, sticky like /tmp)."""
    folder = tempfile.mkdtemp(dir="/tmp")
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.slow
def test_a_lock_file_another_user_left_behind_never_stops_a_run(shared_folder):
    """A lock file a run of root's left (no process holds it) in a shared folder: another user's run takes the lock
    through a read-only descriptor; one it cannot open at all is one sentence saying that no lock can be told and how
    to clear it; one a live run holds is "in use"."""
    ck, metrics = os.path.join(shared_folder, "ck.pt"), os.path.join(shared_folder, "m.jsonl")
    for path in (ck, metrics):
        with open(paths.lock_file(path), "a"):  # as a run of root's leaves them, umask 022: 0644
            pass
    take = (
        f"hp = types.SimpleNamespace(checkpoint_path={ck!r}, metrics_path={metrics!r})\n"
        "try:\n    paths.lock_outputs(hp, print).close(); print('locked')\nexcept ValueError as e:\n    print(e)"
    )
    done = as_nobody(take, shared_folder)
    assert done.stdout == "locked\n", done.stdout + done.stderr
    os.chmod(paths.lock_file(ck), 0o600)  # not even readable
    done = as_nobody(take, shared_folder)
    assert done.stdout == (
        f"--checkpoint_path {ck}: its lock file {paths.lock_file(ck)} belongs to root and it cannot be opened "
        f"(Permission denied), so whether a running train.py holds it cannot be told; if none does, remove it (it "
        f"holds nothing: only a running train.py's lock on it counts)\n"
    ), done.stderr
    os.chmod(paths.lock_file(ck), 0o644)
    with open(paths.lock_file(ck)) as held:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        done = as_nobody(take, shared_folder)
    assert f"--checkpoint_path {ck} is in use by another running train.py" in done.stdout, done.stderr
    os.remove(paths.lock_file(ck))
    done = as_nobody(take, shared_folder)  # a lock file made now is open to every user
    assert done.stdout == "locked\n" and os.stat(paths.lock_file(ck)).st_mode & 0o777 == 0o666


def test_a_lock_file_only_readable_on_storage_whose_locks_need_write_access_is_one_sentence(tmp_path, monkeypatch):
    """NFS takes a flock as a byte-range lock, which a read-only descriptor cannot hold (EBADF): reached through
    paths.os.open and paths.fcntl, the cases a second user makes on such storage."""
    import errno

    path = tmp_path / "ck.pt"
    open(paths.lock_file(str(path)), "a").close()
    real_open, real_flock = os.open, paths.fcntl.flock

    def open_denied(name, flags, *mode):  # the file exists (EEXIST first), but only to read
        if name.endswith(".lock") and not flags & os.O_EXCL and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real_open(name, flags, *mode)

    def flock(fd, operation):
        if paths.fcntl.fcntl(fd, paths.fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, operation)

    monkeypatch.setattr(paths.os, "open", open_denied)
    monkeypatch.setattr(paths.fcntl, "flock", flock)
    with pytest.raises(ValueError, match=r"belongs to root and it cannot be opened to write, so whether a running"):
        paths.take_lock(str(path), "checkpoint_path", "wait")


# ----------------------------------------------------------------------------- a disk that fills up under the run


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs: room for two of a tiny run's checkpoints side by side, until another job fills it."""
    with tmpfs(tmp_path / "tmpfs", "4M") as mount:
        yield mount


@pytest.mark.slow
def test_a_disk_that_fills_up_under_the_run_keeps_the_last_checkpoint_and_training_goes_on(tmp_path, small_tmpfs):
    """The ~1.2 MB checkpoint (without the bigram table) passes the room check on a 4 MB tmpfs (two of it, side by
    side); then another job fills the disk: every later save fails, said once, and the last whole file stays."""
    args = [
        *TINY,
        "--bigram_mult",
        "0",
        "--checkpoint_path",
        str(small_tmpfs / "ck.pt"),
        "--metrics_path",
        str(tmp_path / "m.jsonl"),
        "--val_tokens",
        "8192",
        "--time_limit_min",
        "0.25",
        "--save_every_min",
        "0.03",
    ]
    proc = subprocess.Popen(
        command(args, 1), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        first_row(proc, tmp_path / "m.jsonl")
        filler = small_tmpfs / "another_job"
        with open(filler, "wb") as file:  # leaves less than one checkpoint free
            file.write(b"\1" * (os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize - (1 << 19)))
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert len([line for line in out.splitlines() if "background checkpoint save failed" in line]) == 1
    failed = next(line for line in out.splitlines() if "the final save failed" in line)
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize / 2**20
    size = os.path.getsize(small_tmpfs / "ck.pt") / 2**20
    said = rf"the disk is full: the save writes 1\.\d MiB beside the {size:,.1f} MiB file it replaces, and .* has "
    assert re.search(said + rf"{free:,.1f} MiB free\); the file is left as it was; .* holds step \d+", failed), failed
    assert "Traceback" not in err
    _, _, summary = read_metrics(tmp_path / "m.jsonl")
    assert summary["steps"] > 5  # training went on
    _, ckpt = load_checkpoint(small_tmpfs / "ck.pt")
    assert ckpt["step"] == summary["weights_step"] < summary["steps"] and not list(small_tmpfs.glob("*.tmp"))


# ---------------------------------------------------------- labels that match the weights on every path that ends a run


TAIL = ["--tail_ema", "0.6", "--tail_ema_horizon", "0.1", "--progress_by", "steps", "--log_every_s", "0"]


STEPS = 6


ON_TAIL = [*TINY, *TAIL, "--max_steps", str(STEPS), "--save_every_min", "0", "--time_limit_min", "10"]


AT_THE_END = (  # the host sync after the last step rolls back (a spike, forced), then the run stops on max_steps
    "import rollback\n"
    "real_sync, real_diverged = train.Trainer.host_sync, rollback.Guard.diverged\n"
    "def host_sync(trainer, elapsed):\n"
    "    rollback.AT_END = trainer.step >= trainer.hp.max_steps\n"
    "    return real_sync(trainer, elapsed)\n"
    "train.Trainer.host_sync = host_sync\n"
    "rollback.Guard.diverged = lambda self, loss: 'a forced spike' if rollback.AT_END else real_diverged(self, loss)\n"
)


def initial_weights(ckpt):
    torch.manual_seed(ckpt["config"]["seed"])  # launch.build_model's weights, bit for bit (test_startup.py)
    return get_model(ckpt["config"]).state_dict()


@pytest.mark.slow
def test_a_rollback_at_the_last_sync_with_the_tail_ema_on_is_labelled_plain(tmp_path):
    proc, _ = patched_train(tmp_path, AT_THE_END, ON_TAIL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["rollbacks"][0]["step"] == STEPS and summary["steps"] == STEPS
    # the trusted snapshot restored is the initial weights': the file holds exactly those, and says so
    assert all(torch.equal(value, initial_weights(ckpt)[name]) for name, value in ckpt["model"].items())
    assert ckpt["weights"] == summary["weights"] == "plain" and ckpt["step"] == summary["weights_step"] == 0
    assert "final weights:" not in proc.stdout and "(step 0, plain weights)" in proc.stdout


@pytest.mark.slow
def test_weights_not_finite_at_the_end_are_restored_and_labelled_plain(tmp_path):
    """The token embedding (outside the tail EMA) turns non-finite at the last step: the weights go back to the
    trusted snapshot, whatever the blend made of them before."""
    poison = (
        "real_step = train.Trainer.train_step\n"
        "def train_step(trainer):\n"
        "    stepped = real_step(trainer)\n"
        "    if trainer.step == trainer.hp.max_steps:\n"
        "        trainer.run.raw_model.wte.weight.data[0, 0] = float('nan')\n"
        "    return stepped\n"
        "train.Trainer.train_step = train_step\n"
    )
    proc, _ = patched_train(tmp_path, poison, ON_TAIL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert all(torch.equal(value, initial_weights(ckpt)[name]) for name, value in ckpt["model"].items())
    assert ckpt["weights"] == summary["weights"] == "plain" and ckpt["step"] == summary["weights_step"] == 0
    assert "final weights:" not in proc.stdout


@pytest.mark.slow
def test_a_failed_final_save_labels_the_checkpoint_on_disk_not_the_weights_in_memory(tmp_path):
    failing = (
        "real = checkpoint.save_checkpoint\n"
        "def save(state, path):\n"
        "    if state['step'] > 0: raise checkpoint.CheckpointError('could not save it (No space left on device)')\n"
        "    real(state, path)\n"
        "checkpoint.save_checkpoint = save\n"
    )
    proc, _ = patched_train(tmp_path, failing, ON_TAIL)
    assert proc.returncode == 1, proc.stderr[-3000:]
    _, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert ckpt["step"] == summary["weights_step"] == 0 and ckpt["weights"] == summary["weights"] == "plain"
    assert summary["steps"] == STEPS and "final weights: 0.4 x weights + 0.6 x their tail EMA" in proc.stdout
    assert (
        "checkpoint.pt holds step 0, the last save that succeeded" in proc.stdout
        and "(step 0, plain weights)" in proc.stdout
    )


# -------------------------------------------------------------- a run refused after its checks began leaves nothing new


@pytest.mark.slow
def test_a_run_refused_after_its_outputs_were_locked_leaves_nothing_new(tmp_path):
    """The step-0 save cannot start (after the locks and the metrics file to be were made): exit 2, and the folder is
    as it was: no lock file, no metrics file, no folder made for them."""
    cannot_start = (
        "def save(self, model, meta, background): raise checkpoint.CheckpointError('cannot start it')\n"
        "checkpoint.Checkpointer.save = save\n"
    )
    (tmp_path / "kept.txt").write_text("a file of the user's")
    proc, _ = patched_train(tmp_path, cannot_start, [*TINY, "--checkpoint_path", "new/ck.pt", "--max_steps", "2"])
    assert proc.returncode == 2 and "cannot start it" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]

"""The fifth fault round: the room a save really needs, outputs known by identity (locks, and no file written through
another of its names), labels that match the weights on every path that ends a run, checks that leave nothing behind.
The room and probe cases on a real full disk are in test_checkpoint.py (a tmpfs)."""

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import types

import pytest
import torch

import checkpoint
import paths
from conftest import ROOT, TINY, patched_train, read_metrics, run_train
from eval import load_checkpoint
from model import get_model

# ----------------------------------------------------------------------------- 1. the room a save needs


def test_the_room_asked_for_is_two_files_less_what_replacing_the_one_there_frees(tmp_path, monkeypatch):
    """A save writes a whole file beside the one it replaces: with no file at the path, the step-0 save and the next
    need two files' room; a file there of one's size, replaced by the step-0 save, gives its room back; one that
    another name keeps (a hard link) gives nothing back."""
    size = 1 << 20
    need = size + checkpoint.SAVE_OVERHEAD
    free = int(1.5 * need)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(1 << 40, 0, free))
    path = tmp_path / "ck.pt"
    with pytest.raises(ValueError) as refused:
        checkpoint.check_room(str(path), size, "checkpoint_path")
    mib = need / 2**20
    assert str(refused.value) == (
        f"--checkpoint_path {path}: each save writes a whole {mib:,.1f} MiB checkpoint beside the one it replaces, so "
        f"the run needs {2 * mib:,.1f} MiB free in {tmp_path}, and it has {1.5 * mib:,.1f} MiB; free some room or "
        f"point --checkpoint_path at another volume"
    )
    path.write_bytes(b"\1" * need)  # a previous run's checkpoint of this size: the step-0 save frees it
    checkpoint.check_room(str(path), size, "checkpoint_path")
    os.link(path, tmp_path / "snapshot.pt")  # kept by another name: replacing it frees nothing
    with pytest.raises(ValueError, match=r"another name \(a hard link\) and replacing it frees nothing"):
        checkpoint.check_room(str(path), size, "checkpoint_path")


# ----------------------------------------------------------------------------- 2. outputs known by identity


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


def test_two_paths_to_one_output_through_a_bind_mount_are_one_output(tmp_path):
    """Neither file exists yet, and the paths differ even when resolved: their place (the folder's identity and the
    name) is the same, so the run is refused for naming one file twice, not for a run that is not there."""
    for folder in ("run", "bind"):
        (tmp_path / folder).mkdir()
    done = subprocess.run(["mount", "--bind", str(tmp_path / "run"), str(tmp_path / "bind")], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.decode().strip()}")
    try:
        hp = types.SimpleNamespace(
            data_dir=None,
            val_file=None,
            checkpoint_path=str(tmp_path / "run" / "x"),
            metrics_path=str(tmp_path / "bind" / "x"),
        )
        with pytest.raises(ValueError, match="--metrics_path and --checkpoint_path are both"):
            paths.check_outputs(hp, print)
    finally:
        subprocess.run(["umount", str(tmp_path / "bind")], check=True)


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


# ----------------------------------------------------------------------------- 3. labels that match the weights

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


# ----------------------------------------------------------------------------- 4. checks that leave nothing behind


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


def test_a_second_run_refused_on_a_metrics_file_in_use_leaves_no_lock_file_of_its_own(tmp_path, own_locks):
    paths.lock_outputs(outputs(tmp_path / "ck.pt", tmp_path / "m.jsonl"), print).close()
    with pytest.raises(ValueError, match="--metrics_path .* is in use"):
        paths.lock_outputs(outputs(tmp_path / "ck2.pt", tmp_path / "m.jsonl"), print)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.pt.lock", ".m.jsonl.lock"]

"""Tests for checkpoint.py: a failed or refused save keeps the previous file and leaves nothing behind; the room a run
asks for before its first save, and the longest file name a save takes."""

import errno
import os
import shutil
import threading

import pytest
import torch

import checkpoint
from checkpoint import Checkpointer, CheckpointError, check_writable, save_checkpoint, unique_sibling
from conftest import tmpfs

torch.set_num_threads(1)


def state(step, n=16, fill=1.0):
    return {"model": {"w": torch.full((n,), fill), "count": torch.tensor(step)}, "config": {"n": n}, "step": step}


def saved_step(path):
    return torch.load(path, weights_only=True)["step"]


def assert_only(folder, *names):
    assert sorted(os.listdir(folder)) == sorted(names)  # no .tmp or .probe left behind


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a disk that fills up."""
    with tmpfs(tmp_path / "small", "2M") as folder:
        yield folder


def test_full_disk_keeps_the_previous_checkpoint_and_no_tmp(small_tmpfs):
    path = small_tmpfs / "ck.pt"
    save_checkpoint(state(1), path)
    with pytest.raises(
        CheckpointError,
        match=r"could not save .*ck\.pt \(the disk is full: the save writes 4\.0 MiB beside the 0\.0 MiB file it "
        r"replaces, and .*small has \d\.\d MiB free\); the file is left",
    ):
        save_checkpoint(state(2, n=1 << 20), path)  # 4 MiB of float32 into 2 MiB
    assert saved_step(path) == 1
    assert_only(small_tmpfs, "ck.pt")


def test_a_failed_save_says_the_free_space_there_is_once_its_file_is_gone(small_tmpfs):
    """A second file of the size beside the first does not fit: the message says the free space as it is after the
    failed file was closed and removed (an open one held its blocks, and the message said 0.0 MiB)."""
    path = small_tmpfs / "ck.pt"
    save_checkpoint(state(1, n=300_000), path)  # 1.1 MiB of the 2
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(state(2, n=300_000), path)
    free = shutil.disk_usage(small_tmpfs).free / 2**20
    assert f"the disk is full: the save writes 1.1 MiB beside the 1.1 MiB file it replaces, and {small_tmpfs} has " in (
        str(failed.value)
    ) and f"{free:,.1f} MiB free)" in str(failed.value)
    assert free > 0.5 and saved_step(path) == 1
    assert_only(small_tmpfs, "ck.pt")


def test_a_write_probe_on_a_full_disk_leaves_nothing_behind(small_tmpfs):
    with open(small_tmpfs / "filler", "wb") as filler:
        filler.write(b"\1" * shutil.disk_usage(small_tmpfs).free)
    for path in (small_tmpfs / "ck.pt", small_tmpfs / "new" / "sub" / "ck.pt"):
        with pytest.raises(ValueError, match="is not writable: cannot write in .* \\(No space left on device\\)"):
            check_writable(str(path), "checkpoint_path")
        assert_only(small_tmpfs, "filler")  # neither the probe nor the folders made for it


def test_write_error_mid_save_keeps_the_previous_checkpoint_and_no_tmp(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_checkpoint(state(1), path)

    def full_disk(obj, f):
        f.write(b"PK partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(state(2), path)
    assert saved_step(path) == 1
    assert_only(tmp_path, "ck.pt")


def test_directory_path_is_one_clear_error(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"--checkpoint_path .*ckpts is a folder; name a file"):
        check_writable(str(folder), "checkpoint_path")
    with pytest.raises(CheckpointError, match="is a folder"):
        save_checkpoint(state(1), folder)
    assert_only(folder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_state_is_refused_and_the_previous_file_kept(tmp_path, bad):
    path = tmp_path / "ck.pt"
    save_checkpoint(state(1), path)
    broken = state(2)
    broken["model"]["w"][3] = bad
    with pytest.raises(CheckpointError, match="refusing to save .* at step 2: w holds NaN or inf"):
        save_checkpoint(broken, path)
    assert saved_step(path) == 1
    assert_only(tmp_path, "ck.pt")


def test_temporary_and_probe_names_differ_across_hosts_ranks_and_calls(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)  # containers: every node's rank 0 can have the same pid
    names = set()
    for host in ("node0", "node1", "node1"):
        monkeypatch.setattr(checkpoint.socket, "gethostname", lambda host=host: host)
        names |= {unique_sibling("ck.pt", "tmp"), unique_sibling("ck.pt", "tmp"), unique_sibling("ck.pt", "probe")}
    assert len(names) == 9
    assert sum(n.endswith(".tmp") for n in names) == 6 and all(n.startswith("ck.pt.node") for n in names)
    check_writable(str(tmp_path / "ck.pt"), "checkpoint_path")
    assert_only(tmp_path)


def test_two_runs_saving_to_one_path_never_collide(tmp_path):
    path, errors = tmp_path / "ck.pt", []

    def run(first_step):
        try:
            for step in range(first_step, first_step + 20):
                save_checkpoint(state(step), path)
        except (OSError, ValueError) as e:  # the shared-.tmp bug showed as FileNotFoundError in one of the runs
            errors.append(e)

    runs = [threading.Thread(target=run, args=(s,)) for s in (0, 100)]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert errors == [] and saved_step(path) in (19, 119)
    assert_only(tmp_path, "ck.pt")


def test_background_failure_is_reported_once_without_a_traceback(tmp_path, monkeypatch, capfd):
    path = tmp_path / "ck.pt"
    model = torch.nn.Linear(4, 4)
    saver = Checkpointer(path)
    saver.save(model, {"step": 1}, background=True)
    assert saver.wait() is None and saved_step(path) == 1

    def full_disk(obj, f):
        raise OSError(errno.ENOSPC, "full")

    real_save = checkpoint.torch.save
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    messages = []
    for step in (2, 3, 4):  # a full disk fails every save the same way: said once, counted three times
        saver.save(model, {"step": step}, background=True)
        messages.append(saver.wait())
    assert messages[1:] == [None, None] and saver.failures == 3
    assert "could not save" in messages[0] and "(full: the save writes" in messages[0]
    assert saver.poll() is None
    with pytest.raises(CheckpointError, match="could not save"):  # the final, foreground save raises instead
        saver.save(model, {"step": 5}, background=False)
    assert saved_step(path) == 1
    assert capfd.readouterr().err == ""  # no thread traceback

    monkeypatch.setattr(checkpoint.torch, "save", real_save)  # space freed: saving works again
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    saver.save(model, {"step": 6}, background=True)
    assert "at step 6: weight holds NaN or inf" in saver.wait()
    assert saved_step(path) == 1 and saver.failures == 4
    assert_only(tmp_path, "ck.pt")


# --------------------------------------------------------------------- the room a save needs, and the names it can take


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


def test_a_checkpoint_name_at_the_file_system_limit_saves_and_one_past_it_is_one_sentence(tmp_path):
    import checkpoint

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("c" * (limit - 3) + ".pt")  # legal; its temporary sibling is cut to fit
    checkpoint.check_writable(str(longest), "checkpoint_path")
    checkpoint.Checkpointer(str(longest)).save(torch.nn.Linear(2, 2), {"step": 1}, background=False)
    assert [p.name for p in tmp_path.iterdir()] == [longest.name]
    with pytest.raises(ValueError, match=f"--checkpoint_path names a file of {limit + 1} bytes, longer than the"):
        checkpoint.check_writable(str(tmp_path / ("c" * (limit + 1))), "checkpoint_path")

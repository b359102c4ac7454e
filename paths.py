"""The files a run reads and writes, checked before anything is written: an output path that would destroy an input
or land somewhere unexpected, an output another running train.py holds, a validation file that is a copy of a
training file. launch.checked_inputs calls these; a failure is a ValueError or an OSError, one sentence.
"""

import dataclasses
import errno
import fcntl
import os
import stat

from checkpoint import check_writable, name_max
from data import find_token_files


def check_outputs(hp, say):
    """The checkpoint and metrics paths, checked against every way an output can destroy an input or land
    somewhere unexpected; returns hp with a symlinked output replaced by its target (written, and said so). Files
    are compared by identity (device, inode), not by path: a hard link or a bind mount reaches an input too."""
    folder = hp.data_dir or ""
    names = [os.path.join(folder, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])]
    given = [*names, *([hp.val_file] if hp.val_file else [])]
    inputs = {**{os.path.realpath(p): p for p in given}, **{file_identity(p): p for p in given}}
    inputs.pop(None, None)
    resolved = {}
    for flag in ("checkpoint_path", "metrics_path"):
        path = getattr(hp, flag)
        if not path.strip():
            raise ValueError(f"--{flag} is empty; name a file")
        real = os.path.realpath(path)
        if (key := file_identity(path)) in inputs or (key := real) in inputs:
            raise ValueError(f"--{flag} {path} is the input file {inputs[key]}; writing it would destroy it")
        if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode) and not os.path.isdir(real):
            raise ValueError(f"--{flag} {path} is a device, pipe or socket, not a file a checkpoint can replace")
        if os.path.islink(path):
            say(f"--{flag} {path} is a symlink: writing its target, {real}")
        resolved[flag] = real if os.path.islink(path) else path
        check_writable(resolved[flag], flag)
    same = os.path.realpath(resolved["checkpoint_path"]) == os.path.realpath(resolved["metrics_path"])
    if same or file_identity(resolved["checkpoint_path"]) == file_identity(resolved["metrics_path"]) is not None:
        raise ValueError(
            f"--metrics_path and --checkpoint_path are both {resolved['metrics_path']}; each needs its own file"
        )
    return dataclasses.replace(hp, **resolved)


def file_identity(path):
    """(device, inode) of the file path reaches (through symlinks), or None when there is none: every path to one
    file (a hard link, a symlink, a bind mount) has the same."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def training_twin(val_file, data_dir, head_bytes=1 << 20):
    """The training file that val_file is (the same file, or a copy: the same size and first MiB), else None."""

    def head(path):
        with open(path, "rb") as file:
            return file.read(head_bytes)

    for path in find_token_files(data_dir):
        same_size = os.path.getsize(path) == os.path.getsize(val_file)
        if os.path.realpath(path) == os.path.realpath(val_file) or (same_size and head(path) == head(val_file)):
            return path
    return None


OUTPUT_LOCKS = []  # this process's output locks, open for its whole life: closing a lock file releases its lock


def lock_outputs(hp, say):
    """Own the checkpoint and the metrics file before writing either, and return the metrics file, open to append: a
    second train.py on either path (as its checkpoint or its metrics) is refused, one sentence. The checkpoint first:
    once it is ours, another metrics path is a safe way round a metrics file in use."""
    advice = {
        "checkpoint_path": "wait for it to end, or give this run its own --checkpoint_path and --metrics_path",
        "metrics_path": "give this run its own --metrics_path",
    }
    taken, unlockable = [], []
    for flag in ("checkpoint_path", "metrics_path"):
        path = getattr(hp, flag)
        taken.append(open(lock_file(path), "a"))
        try:
            fcntl.flock(taken[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # storage without locks: not "in use"
                unlockable.append(f"{path} ({e.strerror})")
                continue
            for handle in taken:
                handle.close()
            raise ValueError(f"--{flag} {path} is in use by another running train.py; {advice[flag]}") from None
    if unlockable:
        say(f"warning: {' and '.join(unlockable)} cannot be locked here; a second run on them would not be refused")
    OUTPUT_LOCKS.extend(taken)
    return open(hp.metrics_path, "a")


def lock_file(path):
    """The file an output's lock is held on: a hidden sibling (.NAME.lock), which stays when the output is replaced
    by a rename (every checkpoint save), so the lock outlives the saves; the name is cut to fit the file system."""
    folder, name = os.path.split(path)
    room = name_max(os.path.abspath(folder or ".")) - len("..lock")
    return os.path.join(folder, f".{name.encode()[:room].decode(errors='ignore')}.lock")

"""Checkpoint I/O: always a complete, finite file on disk, written without holding up training.

checkpoint.pt = {"model": plain CPU state_dict, "config": plain dict, "step", "tokens"}: what the organizers'
`torch.load(..., weights_only=True)` + `get_model(ckpt["config"])` + `load_state_dict` needs, nothing else.
Rules: nothing non-finite is ever written; a failed save keeps the previous file and leaves no temporary file;
a failed background save is reported once, as one sentence, and training goes on.
"""

import errno
import os
import secrets
import shutil
import socket
import stat
import threading
import time

import torch


class CheckpointError(ValueError):
    """A save that did not happen, in one sentence; the previous checkpoint, if any, is intact."""


def name_max(folder):
    """The longest file name (bytes) the file system holding folder takes; 255 where it cannot say."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        return os.pathconf(folder or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def unique_sibling(path, kind):
    """A name beside path that no other process writes: ranks on different nodes can share a pid (containers)
    and a hostname, so a random part is added to host and pid. Ends in .kind, so leftovers glob as *.kind. The
    name part is cut so that the whole fits the file system's name limit: any legal path has a legal sibling."""
    suffix = f".{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"
    folder, name = os.path.split(path)
    room = max(name_max(os.path.abspath(folder or ".")) - len(suffix.encode()), 1)
    return os.path.join(folder, name.encode()[:room].decode(errors="ignore") + suffix)


def check_writable(path, flag):
    """Fail now, not after ten minutes of training, if the file cannot be written. Whatever the probe makes (the
    folders on the way, its file) is removed again on every outcome: a refusal, even on a full disk, leaves nothing."""
    if os.path.isdir(path):
        raise ValueError(f"--{flag} {path} is a folder; name a file, e.g. {os.path.join(path, 'checkpoint.pt')}.")
    folder = os.path.dirname(os.path.abspath(path))
    if len(name := os.path.basename(path).encode()) > (limit := name_max(folder)):
        raise ValueError(
            f"--{flag} names a file of {len(name)} bytes, longer than the {limit} the file system of {folder} takes."
        )
    probe, made = unique_sibling(path, "probe"), missing_folders(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)  # where a full disk shows on some file systems
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"--{flag} {path} is not writable: cannot write in {folder} ({e.strerror})") from None
    finally:
        remove_quietly(probe, *reversed(made))


def missing_folders(folder):
    """The folders os.makedirs(folder) would create, outermost first."""
    missing: list[str] = []
    while folder and not os.path.lexists(folder):
        missing.insert(0, folder)
        folder = os.path.dirname(folder)
    return missing


def remove_quietly(*paths):
    """Remove each file, or empty folder, that is there; what cannot be removed stays."""
    for path in paths:
        try:
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        except OSError:
            pass


# a file's bytes beyond its tensors': the pickled config and ~400 B of zip records per tensor (19 KB measured for
# l4w128's 48 tensors; the event's l16w1024 has 149)
SAVE_OVERHEAD = 256 << 10


def freed_by_replacing(path):
    """Bytes that replacing the file at path frees: its blocks, or nothing when there is none or another name (a hard
    link) keeps it."""
    try:
        info = os.stat(path)
    except OSError:
        return 0
    return info.st_blocks * 512 if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 else 0


def check_room(path, nbytes, flag):
    """Fail now if the saves of checkpoints of nbytes of tensors cannot all fit: each writes a complete file beside the
    one it replaces before renaming it over, so the step-0 save needs one file's room and every later one (the final
    save included) two, less what replacing the file at path now frees. A quota that statvfs does not show is not
    seen here; where the free space cannot be read, the save will tell."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    size, freed = nbytes + SAVE_OVERHEAD, freed_by_replacing(path)
    need = max(size, 2 * size - freed)
    if free < need:
        mib = 2**20
        there = f", less the {freed / mib:,.1f} MiB the file there now frees" if freed else ""
        if not freed and os.path.exists(path):
            there = ", as the file there now has another name (a hard link) and replacing it frees nothing"
        raise ValueError(
            f"--{flag} {path}: each save writes a whole {size / mib:,.1f} MiB checkpoint beside the one it replaces, "
            f"so the run needs {need / mib:,.1f} MiB free in {folder}{there}, and it has {free / mib:,.1f} MiB; free "
            f"some room or point --{flag} at another volume"
        )


def cpu_state_dict(model):
    """A CPU copy: loads on any machine without map_location, and training can go on while it is written."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def non_finite_tensor(state_dict):
    """The name of the first floating tensor holding a NaN or inf, else None."""
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def save_checkpoint(state, path):
    """Write state to a unique temporary file, flush it to disk, rename it into place; raise CheckpointError
    (with the previous file intact and the temporary file removed) when any of that fails."""
    if os.path.isdir(path):
        raise CheckpointError(f"cannot save the checkpoint: {path} is a folder, not a file name.")
    if (name := non_finite_tensor(state["model"])) is not None:
        raise CheckpointError(
            f"refusing to save {path} at step {state.get('step')}: {name} holds NaN or inf; the file is left as it was."
        )
    tmp = unique_sibling(path, "tmp")
    try:
        # a file of our own, closed on every outcome: an open one would hold its blocks after the removal below,
        # and the free space said would be wrong. "x": never written through another name of an existing file
        with open(tmp, "xb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # on NFS a full disk can first show at the flush, after torch.save returned
        os.replace(tmp, path)
    except Exception as e:  # any failure leaves no temporary file
        remove_quietly(tmp)
        raise CheckpointError(
            f"could not save {path} ({_save_failure(state, path, e)}); the file is left as it was."
        ) from None


def _save_failure(state, path, error):
    """Why a save failed, in words: torch.save words a full disk as "unexpected pos 4608 vs 4500", with the OSError
    only in its context; the free space is read after the temporary file is closed and removed."""
    size = sum(t.nbytes for t in state["model"].values())  # the file's bulk: its config and records add ~20 KB
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    oserror = next((e for e in (error, error.__cause__, error.__context__) if isinstance(e, OSError)), None)
    beside = f" beside the {os.path.getsize(path) / 2**20:,.1f} MiB file it replaces" if os.path.isfile(path) else ""
    writes = f"the save writes {size / 2**20:,.1f} MiB{beside}"
    if oserror is not None and oserror.errno == errno.EDQUOT:
        return f"the disk quota is exceeded: {writes}, more than it leaves"
    if free is not None and free < size:
        return f"the disk is full: {writes}, and {folder} has {free / 2**20:,.1f} MiB free"
    if oserror is not None and oserror.errno == errno.ENOSPC:
        shown = "" if free is None else f", though {folder} shows {free / 2**20:,.1f} MiB free (no inodes left?)"
        return f"{oserror.strerror}: {writes}{shown}"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}" if str(error) else type(error).__name__


class Checkpointer:
    """Rank 0 snapshots to CPU and writes in a thread, so periodic saves cost one copy, not a disk write.
    A background failure never raises in the thread: poll() or wait() returns its message, once per distinct
    message (a full disk fails every save the same way); .failures counts them all. .written: the unix time each
    step's file was in place; .on_disk: the labels (step, tokens, weights) of the file in place now, None before one.
    The thread is not a daemon: however the process ends (an error, a lost peer, sys.exit), the interpreter waits for
    the save it started, so the file it promised is on disk."""

    def __init__(self, path):
        self.path, self.failures, self.written, self.on_disk = path, 0, {}, None
        self._thread, self._error, self._reported = None, None, None

    def save(self, model, meta, background):
        """Snapshot now; write in a thread (background) or here, raising CheckpointError if it fails."""
        self._join()
        state = {"model": cpu_state_dict(model), **meta}
        if background:
            self._thread = threading.Thread(target=self._write, args=(state,))
            self._thread.start()
        else:
            self._put_in_place(state)

    def _put_in_place(self, state):
        save_checkpoint(state, self.path)
        self.written[state.get("step")] = time.time()
        self.on_disk = {k: state.get(k) for k in ("step", "tokens", "weights")}

    def _write(self, state):
        try:
            self._put_in_place(state)
        except CheckpointError as e:
            self._error = str(e)
        except Exception as e:  # anything else: still one line, not a thread traceback
            self._error = f"could not save {self.path}: {type(e).__name__}: {e}"
        if self._error is not None:
            self.failures += 1

    def _join(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def poll(self):
        """The message of a failed background save that finished since the last call, if not said before."""
        if self._thread is not None:
            if self._thread.is_alive():
                return None
            self._join()
        error, self._error = self._error, None
        if error is None or error == self._reported:
            return None
        self._reported = error
        return error

    def wait(self):
        """Wait for a background save; then as poll()."""
        self._join()
        return self.poll()

"""Checkpoint I/O: always a complete, finite file on disk, written without holding up training.

checkpoint.pt = {"model": plain CPU state_dict, "config": plain dict, "step", "tokens"}: what the organizers'
`torch.load(..., weights_only=True)` + `get_model(ckpt["config"])` + `load_state_dict` needs, nothing else.
Rules: nothing non-finite is ever written; a failed save keeps the previous file and leaves no temporary file;
a failed background save is reported once, as one sentence, and training goes on.
"""

import os
import secrets
import shutil
import socket
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
    """Fail now, not after ten minutes of training, if the file cannot be written."""
    if os.path.isdir(path):
        raise ValueError(f"--{flag} {path} is a folder; name a file, e.g. {os.path.join(path, 'checkpoint.pt')}.")
    folder = os.path.dirname(os.path.abspath(path))
    if len(name := os.path.basename(path).encode()) > (limit := name_max(folder)):
        raise ValueError(
            f"--{flag} names a file of {len(name)} bytes, longer than the {limit} the file system of {folder} takes."
        )
    probe = unique_sibling(path, "probe")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--{flag} {path} is not writable: cannot write in {folder} ({e.strerror})") from None


def check_room(path, nbytes, flag):
    """Fail now if the file system holding path has less than nbytes free: a background save that cannot fit would
    only say so after training started. Where the free space cannot be read, the save will tell."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < nbytes:
        raise ValueError(
            f"--{flag} {path}: a checkpoint of this model is {nbytes / 2**20:,.1f} MiB, and {folder} has "
            f"{free / 2**20:,.1f} MiB free"
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
        torch.save(state, tmp)
        fd = os.open(tmp, os.O_RDONLY)  # on NFS a full disk can first show at the flush, after torch.save returned
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except Exception as e:  # any failure leaves no temporary file
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise CheckpointError(
            f"could not save {path} ({_save_failure(state, path, e)}); the file is left as it was."
        ) from None


def _save_failure(state, path, error):
    """Why a save failed, in words: torch.save words a full disk as "unexpected pos 4608 vs 4500"."""
    needed = sum(t.nbytes for t in state["model"].values()) / 2**20
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free / 2**20
    except OSError:
        free = None
    if free is not None and free < needed:
        return f"the disk is full: {needed:,.1f} MiB to write, {free:,.1f} MiB free there"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}" if str(error) else type(error).__name__


class Checkpointer:
    """Rank 0 snapshots to CPU and writes in a thread, so periodic saves cost one copy, not a disk write.
    A background failure never raises in the thread: poll() or wait() returns its message, once per distinct
    message (a full disk fails every save the same way); .failures counts them all. .written: the unix time each
    step's file was in place. The thread is not a daemon: however the process ends (an error, a lost peer, sys.exit),
    the interpreter waits for the save it started, so the file it promised is on disk."""

    def __init__(self, path):
        self.path, self.failures, self.written = path, 0, {}
        self._thread, self._error, self._reported = None, None, None

    def save(self, model, meta, background):
        """Snapshot now; write in a thread (background) or here, raising CheckpointError if it fails."""
        self._join()
        state = {"model": cpu_state_dict(model), **meta}
        if background:
            self._thread = threading.Thread(target=self._write, args=(state,))
            self._thread.start()
        else:
            save_checkpoint(state, self.path)
            self.written[state.get("step")] = time.time()

    def _write(self, state):
        try:
            save_checkpoint(state, self.path)
            self.written[state.get("step")] = time.time()
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

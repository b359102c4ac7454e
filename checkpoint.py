"""Checkpoint I/O: always a complete file on disk, written without holding up training.

checkpoint.pt = {"model": plain CPU state_dict, "config": plain dict, "step", "tokens"}: what the organizers'
`torch.load(..., weights_only=True)` + `get_model(ckpt["config"])` + `load_state_dict` needs, nothing else.
"""
import os
import threading

import torch


def check_writable(path, flag):
    """Fail now, not after ten minutes of training, if the checkpoint cannot be written."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        probe = f"{path}.probe{os.getpid()}"
        with open(probe, "wb") as fh:
            fh.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--{flag} {path} is not writable: cannot write in {folder} ({e.strerror})") from None


def cpu_state_dict(model):
    """A CPU copy: loads on any machine without map_location, and training can go on while it is written."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def save_checkpoint(state, path):
    """Write to a temporary file and rename into place: never a half-written checkpoint."""
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


class Checkpointer:
    """Rank 0 snapshots to CPU and writes in a thread, so periodic saves cost one copy, not a disk write."""

    def __init__(self, path):
        self.path, self.thread = path, None

    def save(self, model, meta, background):
        self.wait()
        state = {"model": cpu_state_dict(model), **meta}
        if background:
            self.thread = threading.Thread(target=save_checkpoint, args=(state, self.path), daemon=True)
            self.thread.start()
        else:
            save_checkpoint(state, self.path)

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None

"""The training state beside the organizers' checkpoint, so that a run can go on in another job: the weights and the
optimizer state, saved with torch.distributed.checkpoint (each rank writes its share; a world of one writes alone),
and what the loop needs to continue (step, tokens, trained seconds, the clock, the rollback guard, the tail EMA, each
rank's place in the data, RNG, the jobs so far) in meta.json.

    checkpoint.pt                        the organizers' file, as ever: model + config
    checkpoint.pt.state/latest.json      names the last complete state; replaced by a rename once it is complete
    checkpoint.pt.state/step-N-XXXXXXXX/ torch.distributed.checkpoint's files and meta.json

A state folder is complete or unnamed: a job killed while writing one leaves the last one named (the next save
removes the unnamed one). A resumed run must be the run that saved it: the same model, recipe, data and world size
(fingerprint), said in one sentence where it is not.
"""

import base64
import dataclasses
import json
import os
import re
import secrets
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from ranks import leave_together

STATE_SUFFIX = ".state"
LATEST = "latest.json"
META = "meta.json"
STATE_FORMAT = 1
# flags a resumed run may change: where its files go and how it reports, waits and compiles; any other flag shapes the
# run's trajectory, so a resumed run must give the value the state was saved with
MAY_CHANGE = {
    "checkpoint_path", "metrics_path", "resume", "save_state", "budget_spans_jobs", "save_every_min", "log_every_s",
    "slurm_reserve_s", "collective_timeout_min", "on_recompile", "profile", "dry_run", "world_size", "device",
    "compile", "attention", "val_eval_tokens", "val_every_min", "data_dir", "peak_tflops", "device_memory_gib",
}  # fmt: skip


def state_root(checkpoint_path):
    return checkpoint_path + STATE_SUFFIX


# the stop reasons a run goes on from: None (a save mid-run), its job's wall, a stop signal (a preemption)
RESUMABLE = (None, "wall", "signal")


@dataclasses.dataclass
class Resumed:
    """The state a run goes on from: its folder, its meta.json, and once loaded the tail EMA's average."""

    folder: str
    meta: dict
    ema_average: list | None = None

    @property
    def spent(self):
        """Whether the run it was saved by had finished: its budget, its steps, or it diverged."""
        return self.meta["stop_reason"] not in RESUMABLE

    def line(self, budget_s):
        meta, jobs = self.meta, len(self.meta["jobs"])
        done = f"{meta['trained_s']:.0f} s of its {budget_s:.0f} s budget trained over {jobs} job(s)"
        if self.spent:
            return f"resume: the run in {self.folder} has finished ({meta['stop_reason']}, {done}); nothing to do"
        return f"resume: step {meta['step']:,} of the run in {self.folder} ({done}); this is job {jobs + 1}"


def found(hp, rank, world):
    """(the Resumed state this run goes on from, or None; an error sentence, or None), the same on every rank: rank 0
    looks, and tells the others."""
    result: list = [None, None]
    if rank == 0:
        try:
            folder = find(hp.resume, hp.checkpoint_path)
            result[0] = Resumed(folder, read_meta(folder)) if folder else None
        except ValueError as e:
            result[1] = str(e)
    if world > 1:
        dist.broadcast_object_list(result, src=0)
    return result


def find(resume, checkpoint_path):
    """The folder of the last complete state to resume from, or None: --resume auto (beside --checkpoint_path, when
    there is one), none, or the path of a checkpoint or of its state folder (which must hold one)."""
    if resume == "none":
        return None
    root = state_root(checkpoint_path) if resume == "auto" else resume
    if resume != "auto" and not os.path.exists(os.path.join(root, LATEST)):
        root = state_root(resume)
    latest = os.path.join(root, LATEST)
    if not os.path.exists(latest):
        if resume == "auto":
            return None
        raise ValueError(f"--resume {resume}: no training state there (no {latest}); give a run's checkpoint path")
    try:
        with open(latest) as file:
            folder = os.path.join(root, json.load(file)["folder"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {latest} is not a state pointer ({e}); start afresh with --resume none") from None
    if not os.path.isfile(os.path.join(folder, META)):
        raise ValueError(f"--resume: {latest} names {folder}, which holds no {META}; start afresh with --resume none")
    return folder


def read_meta(folder):
    try:
        with open(os.path.join(folder, META)) as file:
            meta = json.load(file)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--resume: {os.path.join(folder, META)} cannot be read ({e}); start afresh with --resume none"
        )
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"--resume: {folder} was saved in another format ({meta.get('format')}, not {STATE_FORMAT})")
    return meta


def state_fingerprint(hp, train_arrays, world, model_config):
    """What a resumed run must share with the run that saved the state: its flags (but MAY_CHANGE), the model, the
    training arrays (file names and token counts: a staged copy of the files is the same data) and the world size."""
    flags = {k: v for k, v in dataclasses.asdict(hp).items() if k not in MAY_CHANGE}
    arrays = [[os.path.basename(getattr(a, "filename", None) or "synthetic"), len(a)] for a in train_arrays]
    return {"flags": flags, "model": model_config, "data": arrays, "world_size": world}


def mismatch(saved, now):
    """One sentence saying how this run differs from the one that saved the state, or None."""
    if saved["world_size"] != now["world_size"]:
        return (
            f"the state was saved by {saved['world_size']} ranks, and this run has {now['world_size']}: each rank's "
            f"place in the data is its own; resume with {saved['world_size']} ranks"
        )
    if saved["data"] != now["data"]:
        return "the state was saved by a run on other training files (their names or sizes differ)"
    if saved["model"] != now["model"]:
        differ = sorted(k for k in saved["model"] if saved["model"][k] != now["model"].get(k))
        return f"the state holds another model: {', '.join(differ)} differ"
    differ = sorted(k for k in now["flags"] if saved["flags"].get(k) != now["flags"][k])
    if differ:
        shown = ", ".join(f"--{k} {saved['flags'].get(k)} (not {now['flags'][k]})" for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        return f"the state was saved by a run with {shown}{more}"
    return None


def rng_state(device):
    """This process's torch RNG states, as text for meta.json."""
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    return [base64.b64encode(s.numpy().tobytes()).decode() for s in states]


def set_rng_state(states, device):
    tensors = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in states]
    torch.set_rng_state(tensors[0])
    if device.type == "cuda" and len(tensors) > 1:
        torch.cuda.set_rng_state(tensors[1], device)


def _state(model, optimizers, ema_average, ema_names):
    """The tensors torch.distributed.checkpoint saves and loads in place: the model's, each optimizer's (keyed by
    parameter name, which makes an optimizer's state if it has none yet; one entry an optimizer, as Snoo holds state
    for the parameters AdamW and Muon hold too) and the tail EMA's."""
    optim = {str(i): get_optimizer_state_dict(model, optimizer) for i, optimizer in enumerate(optimizers)}
    state = {"model": get_model_state_dict(model), "optim": optim}
    if ema_average is not None:
        state["ema"] = dict(zip(ema_names, ema_average))
    return state


def _dcp_kwargs(group):
    """A world of one saves and loads alone (said: torch warns that it assumes so); ranks coordinate in a gloo group
    of the state's own (the training's NCCL collectives never meet a background save's)."""
    if group is not None:
        return {"process_group": group}
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", module="torch.distributed")
    return {"no_dist": True}


def load_state(folder, model, optimizers, ema_average, ema_names, group):
    """The weights, the optimizer state and (into ema_average, a list made for it) the tail EMA, from folder, in place.
    A file torch.distributed.checkpoint cannot read is one sentence."""
    state = _state(model, optimizers, ema_average, ema_names)
    try:
        dcp.load(state, checkpoint_id=folder, **_dcp_kwargs(group))
    except (Exception, CheckpointException) as e:  # the latter a BaseException: every rank's failures, gathered
        why = _first_line(e)
        raise ValueError(f"--resume: the state in {folder} cannot be read ({why}); start afresh with --resume none")
    set_model_state_dict(model, state["model"])
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state["optim"][str(i)])


def resumed_state(hp, rank, world, device, say):
    """The training state this run goes on from (--resume), said either way, or None. A run that had finished ends
    here, exit 0, before anything is written."""
    resumed, error = found(hp, rank, world)
    leave_together(error, device, world, rank)
    if resumed is None:
        if hp.resume == "auto" and hp.save_state:
            say(f"resume: no training state beside {hp.checkpoint_path}: a fresh run")
        return None
    say(resumed.line(hp.time_limit_min * 60))
    if resumed.spent:
        sys.exit(0)
    return resumed


def load_resumed(resumed, model, optimizers, group):
    """The state's weights, optimizer state and tail EMA average (kept in resumed), into the model just built, on
    every rank; None, or why the state cannot be read."""
    names = [n for n, _ in model.named_parameters() if n != "wte.weight"]  # TailEMA's scope
    if resumed.meta["ema"]["average"]:
        resumed.ema_average = [p.detach().clone() for n, p in model.named_parameters() if n != "wte.weight"]
    try:
        load_state(resumed.folder, model, optimizers, resumed.ema_average, names, group)
    except ValueError as e:
        return str(e)
    return None


def folder_bytes(folder):
    total = 0
    for dirpath, _, names in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(dirpath, name)) for name in names)
    return total


def check_state_room(root, nbytes):
    """Fail now if the state saves cannot fit: each writes a whole folder of nbytes beside the last one, removed once
    the new one is complete."""
    folder = os.path.dirname(os.path.abspath(root))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    held = folder_bytes(root) if os.path.isdir(root) else 0
    need = max(nbytes, 2 * nbytes - held)
    if free < need:
        raise ValueError(
            f"--save_state: each training state save writes {nbytes / 2**20:,.1f} MiB beside the last one, so the run "
            f"needs {need / 2**20:,.1f} MiB free in {folder}, and it has {free / 2**20:,.1f} MiB; free some room, "
            f"point --checkpoint_path at another volume or give --save_state false"
        )


class StateWriter:
    """The training state beside the checkpoint, saved by every rank together: in the background (periodic saves:
    torch.distributed.checkpoint's async_save, which copies the tensors, then writes in a thread) or at once (the
    last save of a job). Rank 0 names a state in latest.json once it is complete, then removes the older ones. One
    save at a time; poll() at host syncs completes a background one, wait() before the next and at the end."""

    def __init__(self, checkpoint_path, rank, group):
        self.root, self.rank, self.group = state_root(checkpoint_path), rank, group
        self.pending: tuple | None = None  # (a background save's future, its folder, its meta)
        self.error: str | None = None
        self.saved_step = None

    def save(self, model, optimizers, ema_average, ema_names, meta, background):
        """Save the tensors and, once they are complete, meta; raises (a background save: wait() or poll() say) on a
        failure, and the state named before stays named."""
        self.wait()
        folder = os.path.join(self.root, f"step-{meta['step']:09d}-{secrets.token_hex(4)}")
        if self.group is not None:  # one folder name for every rank
            names = [folder]
            dist.broadcast_object_list(names, src=0)
            folder = names[0]
        state = _state(model, optimizers, ema_average, ema_names)
        try:
            if background:
                self.pending = (dcp.async_save(state, checkpoint_id=folder, **_dcp_kwargs(self.group)), folder, meta)
                return
            dcp.save(state, checkpoint_id=folder, **_dcp_kwargs(self.group))
        except (Exception, CheckpointException) as e:  # the latter a BaseException
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"the training state was not saved ({_first_line(e)})") from None
        self._complete(folder, meta)

    def _complete(self, folder, meta):
        """Rank 0: meta.json into the complete folder, latest.json renamed over the old one, older folders removed."""
        self.saved_step = meta["step"]
        if self.rank != 0:
            return
        _write_json(os.path.join(folder, META), meta)
        _write_json(os.path.join(self.root, LATEST), {"folder": os.path.basename(folder), "step": meta["step"]})
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith("step-") and path != folder:
                shutil.rmtree(path, ignore_errors=True)

    def poll(self):
        """A background save that finished is named (rank 0); its failure, once, as one sentence."""
        if self.pending is not None and self.pending[0].done():
            self._finish_pending(self.pending)
        error, self.error = self.error, None
        return error

    def wait(self):
        if self.pending is not None:
            self._finish_pending(self.pending)
        error, self.error = self.error, None
        return error

    def _finish_pending(self, pending):
        future, folder, meta = pending
        self.pending = None
        try:
            future.result()
            self._complete(folder, meta)
        except (Exception, CheckpointException) as e:
            self.error = f"a background training state save failed ({_first_line(e)})"
            shutil.rmtree(folder, ignore_errors=True)


def _first_line(error):
    """A DCP error in a line: a CheckpointException's message holds each failing rank's traceback, whose error line
    ("RuntimeError: ...") says what failed."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, CheckpointException):
        errors = [line for line in lines[1:] if re.match(r"[\w.]*(Error|Exception)\b", line)]
        return errors[0][:200] if errors else f"CheckpointException: {lines[0][:200] if lines else ''}"
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def _write_json(path, value):
    """Written under a temporary name, flushed and renamed into place: the file is whole or the old one."""
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "w") as file:
        json.dump(value, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


# the loop's counters a next job takes on as they are
COUNTERS = ("step", "tokens", "lr_frac", "progress", "paused", "val_token_s", "last_save", "last_val")


def loop_state(trainer, elapsed):
    """A train.Trainer's state beside the tensors (meta.json): its counters, the clock, the guard, the tail EMA's
    place, the jobs so far, and every rank's place in the data and RNG, gathered."""
    run = trainer.run
    place = [list(trainer.resumed_from or run.loader.position), rng_state(run.device)]
    places = [place] * run.world
    if run.world > 1:
        dist.all_gather_object(places, place)
    return {
        **{name: getattr(trainer, name) for name in COUNTERS},
        "format": STATE_FORMAT,
        "trained_s": elapsed,
        "stop_reason": trainer.stop_reason,
        "clock": trainer.clock.state_dict(),
        "guard": trainer.guard.state_dict(),
        "ema": {**trainer.ema.state_dict(), "average": trainer.ema.average is not None},
        "positions": [position for position, _ in places],
        "rng": [rng for _, rng in places],
        "jobs": [*trainer.jobs, trainer.job(elapsed)],
        "plan": dataclasses.asdict(run.plan),
        "fingerprint": run.fingerprint,
    }


def restore_loop(trainer, meta, ema_average):
    """A train.Trainer goes on from a loop_state: its counters, the clock, the guard, the tail EMA (its average
    loaded beside the weights), this rank's RNG."""
    for name in COUNTERS:
        setattr(trainer, name, meta[name])
    trainer.jobs = meta["jobs"]
    trainer.log.prev_tokens = trainer.tokens  # the first row's rate: this job's tokens over this job's seconds
    trainer.clock.load_state_dict(meta["clock"])
    trainer.guard.load_state_dict(meta["guard"], trainer.step, trainer.tokens)
    trainer.ema.load_state_dict(meta["ema"], ema_average)
    set_rng_state(meta["rng"][trainer.run.rank], trainer.run.device)

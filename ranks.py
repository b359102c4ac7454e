"""The ranks before the clock: the torch this runs on, each rank's place and device (and its share of the node's CPUs
for compile workers), the process group, ranks that leave together, and the collectives the loop uses, warmed.
launch.py calls these in order; train.py's ranks exit through fail, and stop on any of STOP_SIGNALS (and when their
launcher dies: stop_with_the_launcher).

A check that can differ per rank (a node's staged data, a path, a file only one rank cannot read) is followed by
leave_together, so one rank's error stops every rank at once, said once with the rank's number, instead of hanging a
collective.
"""

import ctypes
import datetime
import os
import re
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch._functorch.config
import torch.distributed as dist
from tqdm import tqdm

from muon import all_gather_flat, flat_gather
from kernels import cudnn_release, triton_version


# The oldest torch the run path works on (run end to end on CPU, 2 gloo ranks, compiled): torch.compiler.set_stance
# and its stances came in 2.6. Newer APIs the run uses have a fallback here: all_gather_single (muon.flat_gather),
# the backward lowering switch (lower_backward_in_forward); gloo's ReduceOp.AVG (2.7) is not used.
TORCH_FLOOR = (2, 6)


def torch_problem(version, compiler=torch.compiler, distributed=dist):
    """None when this torch has what the run path needs, else one sentence saying what to install."""
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    floor = ".".join(map(str, TORCH_FLOOR))
    missing = [name for name in ("set_stance",) if not hasattr(compiler, name)]
    missing += [] if flat_gather(distributed) else ["all_gather_into_tensor"]
    if release >= TORCH_FLOOR and not missing:
        return None
    what = f"lacks {', '.join(missing)}" if missing else f"is older than {floor}"
    return f"torch {version} {what}: this trainer needs torch {floor} or newer; install torch>={floor}"


def lower_backward_in_forward(config=torch._functorch.config):
    """Backward graphs compiled in the first forward, not lazily in the first backward: a compiler that fails then
    fails before DDP's reducer expects a backward, and train.first_compiled_step can go on eagerly. Newer than torch
    2.6: without it the run still compiles (measured on 2.6), but a compiler that fails does so in the first backward,
    where the eager fallback is not proven. Returns whether it was set."""
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        return False
    config.force_non_lazy_backward_lowering = True
    return True


def versions(device, attention):
    """One line that says what ran: torch, Triton, and on CUDA the CUDA, cuDNN and NCCL versions, the GPU and its
    compute capability; the ptxas Triton was pointed at, if any; the attention backend (kernels.AttentionChoice's
    label and the op step 0 compiles in)."""
    line = f"torch {torch.__version__} | Triton {triton_version() or 'none'}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        cudnn = cudnn_release(torch.backends.cudnn.version())
        line += (
            f" | CUDA {torch.version.cuda} | cuDNN {cudnn} | NCCL {nccl} | {torch.cuda.get_device_name(device)} "
            f"(sm_{major}{minor})"
        )
    if ptxas := os.environ.get("TRITON_PTXAS_PATH"):
        line += f" | TRITON_PTXAS_PATH {ptxas}"
    return f"{line} | attention {attention}"


INDUCTOR_MAX_WORKERS = 32  # inductor's own cap on compile workers (torch._inductor.config.decide_compile_threads)


def cap_compile_workers(env, compiling, cpus=None):
    """Inductor's compile workers per rank, when the user has not set TORCHINDUCTOR_COMPILE_THREADS: the CPUs this
    process may use over the ranks on its node (LOCAL_WORLD_SIZE), at least 1, at most inductor's own cap; before
    anything compiles (inductor reads it once, at import). Without it every rank of a node starts min(32, CPUs) of
    them at once while step 0 compiles. Returns the line to say, or None when there is nothing to do."""
    if not compiling or env.get("TORCHINDUCTOR_COMPILE_THREADS"):
        return None
    if cpus is None:  # the CPUs this process may run on (a cpuset or taskset narrows them), where Linux says
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(env.get("LOCAL_WORLD_SIZE") or 1)
    workers = min(INDUCTOR_MAX_WORKERS, max(1, cpus // ranks))
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(workers)
    if (config := sys.modules.get("torch._inductor.config")) is not None:  # read already: set it there too
        setattr(config, "compile_threads", workers)
    return (
        f"compile: {workers} inductor compile worker(s) per rank ({cpus} CPUs visible / {ranks} rank(s) on this node)"
    )


class Place(NamedTuple):
    rank: int
    world: int
    local_rank: int


def launcher_env(env):
    """This process's Place from torchrun's variables, checked: without a launcher rank 0 of 1, local rank 0."""
    try:
        rank, world, local_rank = (int(env.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers; launch with torchrun") from None
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} do not fit; launch with torchrun")
    if world > 1 and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        raise ValueError(f"WORLD_SIZE={world} without MASTER_ADDR and MASTER_PORT: launch several ranks with torchrun")
    return Place(rank, world, local_rank)


def cuda_index(local_rank, visible, local_world=None, torchrun=False):
    """The GPU of this rank: LOCAL_RANK when every rank sees the node's GPUs (torchrun), 0 when a launcher gives
    each task one visible GPU (srun --gpus-per-task, CUDA_VISIBLE_DEVICES per rank). Ranks that would share a GPU
    are refused: torchrun's workers all see the same GPUs, so LOCAL_WORLD_SIZE above them is a shared one (NCCL's
    duplicate-GPU error, later); so is a node of several ranks and several GPUs with fewer GPUs than ranks."""
    if local_world is not None and local_world > visible and (torchrun or visible > 1):
        raise ValueError(
            f"{local_world} ranks on this node (LOCAL_WORLD_SIZE) but {visible} GPU(s) visible to each: ranks would "
            f"share a GPU; launch --nproc_per_node={visible}, or give each rank its own GPU"
        )
    if visible == 1:
        return 0
    if not 0 <= local_rank < visible:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU: {visible} are visible to this process; launch one process per "
            f"GPU, or give each process one GPU"
        )
    return local_rank


def init_device(hp, rank, local_rank, world):
    """This rank's device (its GPU, or the CPU), and the process group across ranks: a rank that never comes (a launch
    environment declaring ranks nobody started) is one sentence after --collective_timeout_min, not a traceback."""
    cuda = hp.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        try:
            local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if os.environ.get("LOCAL_WORLD_SIZE") else None
            torchrun = "TORCHELASTIC_RUN_ID" in os.environ
            device = torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count(), local_world, torchrun))
        except ValueError as e:
            fail(f"error: {e}")
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if world > 1:
        timeout = datetime.timedelta(minutes=hp.collective_timeout_min)
        try:
            dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, timeout=timeout)
        except RuntimeError as e:  # DistStoreError, DistNetworkError: a timeout, or a refused or dropped connection
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            fail(
                f"error: rank {rank}: the {world} ranks of WORLD_SIZE did not all join at {where} within "
                f"--collective_timeout_min {hp.collective_timeout_min:g} ({first_line(e, 160)}); start "
                f"every rank (torchrun starts them all) or fix WORLD_SIZE"
            )
    return device


def keep_freed_memory():
    """Let glibc keep freed CPU memory. A CPU step frees and re-allocates the same multi-MB tensors (the 32K-row
    tables' gradients, the head's per-chunk logits); by default glibc maps the large ones fresh or trims them back
    to the kernel, and a default l4w128 step took 148K page faults (5K with this). Returns whether it applied."""
    try:
        libc = ctypes.CDLL(None)
        # order matters: setting the trim threshold alone also pins the mmap threshold at 128 KB
        return libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def sentence(error):
    """An exception a check can meet as one sentence: ours are sentences already, an OSError (one rank's unreadable
    file) names its file; anything else keeps its traceback on this rank's stderr, for whoever debugs it. A lost peer
    (lost_contact) is raised again: no other rank is left to agree with."""
    if isinstance(error, RuntimeError) and dist.is_initialized() and lost_contact(error):
        raise error  # a peer gone in a collective is no input error: lost_peers says it in one sentence
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename or 'a file'}: {error.strerror}" + (f" ({error.filename2})" if error.filename2 else "")
    if not isinstance(error, (ValueError, OSError)):
        traceback.print_exc()
        return f"{type(error).__name__}: {first_line(error)} (traceback above)"
    return str(error)


def leave_together(error, device, world, rank):
    """Go on when no rank has an error (a sentence, or None); else every rank exits 2 now, together, and rank 0 says
    the first failing rank's sentence, naming the rank. One all-reduce, and a sentence sent only on failure: one
    rank's bad input (a node's staged data, an unreadable file) never leaves the others in a collective."""
    failed, first_error = failing_ranks(error, device, world, rank)
    if not failed:
        return
    if rank == 0:
        where = f"rank {failed[0]}: " if world > 1 else ""
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        fail(f"error: {where}{first_error}{others}")
    sys.exit(2)


class Failures(NamedTuple):
    ranks: list  # the ranks whose error is not None, in order
    first_error: object  # the first one's error, or None


def failing_ranks(error, device, world, rank):
    """Failures, the same on every rank: one all-reduce of a flag per rank, and the first failing rank's error sent to
    all only when some rank failed."""
    if world == 1:
        return Failures([rank] if error is not None else [], error)
    flags = torch.zeros(world, device=device)
    flags[rank] = float(error is not None)
    dist.all_reduce(flags)
    failed = flags.nonzero().flatten().tolist()
    if not failed:
        return Failures([], None)
    first_error = [error]
    dist.broadcast_object_list(first_error, src=failed[0])
    return Failures(failed, first_error[0])


def rank_span(ranks):
    """Ranks as a person reads them: "rank 3", "ranks 8-15", "ranks 0, 2, 8-15"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def lost_contact(error):
    """Whether a RuntimeError from training is a peer gone or frozen: a DistError, or a collective's timeout or broken
    connection surfacing elsewhere (gloo inside DDP's gradient hook: "Application timeout caused pair closure")."""
    return isinstance(error, dist.DistError) or any(
        word in str(error).lower() for word in ("timed out", "timeout", "connection")
    )


def first_line(error, limit=200):
    """An exception's message as one line of a sentence: its first non-empty line, cut at limit characters."""
    return (str(error).strip().splitlines() or [""])[0][:limit]


@contextmanager
def lost_peers(when, kept, on_lost=lambda: None):
    """A peer gone or frozen in a collective inside the block (lost_contact) ends this rank with one sentence and exit
    1, not a traceback or a hang until the SLURM wall: on_lost first (what must reach disk), then "lost contact with
    the other ranks{when} (why); {kept}". Any other error is raised as it is."""
    try:
        yield
    except RuntimeError as e:
        if not (dist.is_initialized() and lost_contact(e)):
            raise
        on_lost()
        fail(f"error: rank {dist.get_rank()} lost contact with the other ranks{when} ({first_line(e)}); {kept}", code=1)


def end_ranks(code, device):
    """Every rank meets the others at a final barrier, then exits with code. A peer gone by then takes nothing from the
    run: every rank has saved and validated."""
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as e:
            if not lost_contact(e):
                raise
            rank, why = dist.get_rank(), first_line(e)
            print(
                f"warning: rank {rank}: a peer left before the final barrier ({why}); the run had finished",
                file=sys.stderr,
                flush=True,
            )
        dist.destroy_process_group()
        if device.type == "cpu":  # torch 2.13's gloo can abort in interpreter teardown (~10% of clean runs)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    if code:
        sys.exit(code)


def say_on_rank0(message):
    """A line for the person running the job, once: rank 0's, above the progress bar, not on its line."""
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()


def fail(message, code=2):
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def bf16_grad_hook(state, bucket):
    """DDP gradient all-reduce in bf16: half the bytes of fp32 on the wire, averaged before the cast."""
    buffer = bucket.buffer()
    reduced = buffer.div(dist.get_world_size()).bfloat16()
    future = dist.all_reduce(reduced, async_op=True).get_future()
    return future.then(lambda fut: buffer.copy_(fut.value()[0]))


def warm_collectives(device):
    """One of each collective training uses, so communicator set-up is not paid on the clock."""
    for dtype in (torch.float32, torch.bfloat16):
        dist.all_reduce(torch.ones(1, device=device, dtype=dtype))
    world = dist.get_world_size()
    for dtype in (torch.float32, torch.bfloat16):  # Muon's exchange
        all_gather_flat(torch.empty(world, device=device, dtype=dtype), torch.ones(1, device=device, dtype=dtype))
    dist.barrier()


# every way a job is told to stop: preemption and torchrun (TERM), Ctrl-C (INT), a dropped ssh session (HUP),
# `sbatch --signal` (USR1, USR2), a quit key (QUIT), a CPU-time limit (XCPU)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU")


class StopSignals:
    """Any of STOP_SIGNALS, noted from here on and obeyed by the loop: it finishes the current step (or micro-step),
    saves, validates and exits 0."""

    def __init__(self):
        self.signals: list[int] = []
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), lambda sig, frame: self.signals.append(sig))

    @property
    def received(self):
        return bool(self.signals)


def stop_with_the_launcher(parent=None):
    """Under torchrun, a worker is sent SIGTERM when its launcher dies: torchrun forwards TERM, INT, HUP and QUIT,
    but a signal it does not handle (USR1 from `sbatch --signal`) kills it outright and would orphan the worker.
    parent: the launcher's pid as first seen (default: now). A launcher that died before prctl took effect shows as
    a changed parent; a parent of pid 1 is not a dead one, since torchrun is pid 1 as a container's entrypoint."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the launcher's own forwarding is all there is
        return
    if os.getppid() != parent:  # the launcher died between the first look and prctl
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # linux/prctl.h

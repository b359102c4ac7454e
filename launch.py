"""Before the clock: input checks agreed across ranks, the run plan, the model on its devices, the step-0
checkpoint, the SLURM-aware budget and one of each collective. train.py calls launch() once; the loop then reads
the Run it returns and nothing else.

Ranks agree before anything is written: a check that can differ per rank (a node's staged data, a path) is
followed by an all-reduce of "ok", so one rank's error stops every rank at once instead of hanging a collective.
"""

import ctypes
import dataclasses
import datetime
import errno
import fcntl
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import get_model, model_config
from data import SYNTH_STATES, BatchLoader, Deal, WindowSpec, find_token_files, load_token_data, val_batches
from muon import all_gather_flat, build_optimizers
from plan import AUTO_EFFICIENCY, TOKENS_PER_PARAM, RunPlan, agreed_matmul_rate, device_memory, make_plan
from checkpoint import CheckpointError, Checkpointer, check_writable


@dataclass
class Run:
    """Everything the loop reads, built and checked before the clock."""

    hp: object  # train.Hyperparameters, resolved: no "auto" left (None where the plan decided)
    plan: RunPlan
    budget_s: float
    rank: int
    world: int
    device: torch.device
    raw_model: torch.nn.Module
    model: torch.nn.Module  # raw_model, or its DDP wrapper
    optimizers: list
    loader: BatchLoader
    val: list
    config: dict  # what checkpoints store: the hyperparameters, the plan and model.py's config
    checkpointer: Checkpointer
    metrics: object  # rank 0's locked metrics file, else None
    stop_signal: list
    step0_saved_unix: float
    say: object


def launch(hp, model_switches, stop_signal, say):
    """Everything before the clock, in order: process group, checks, plan, model, step-0 save, warm collectives."""
    try:
        rank, world, local_rank = launcher_env(os.environ)
    except ValueError as e:
        fail(f"error: {e}")
    hp = resolve(hp, world)
    device = init_device(hp, local_rank, world)
    budget_s = training_budget(hp, rank, device, world, say)  # first: the plan is made for the budget the run gets
    hp, data, val, plan, loader, metrics = checked_inputs(hp, model_switches, rank, world, device, budget_s, say)
    raw_model, model, optimizers = build_model(hp, plan, model_switches, device, world)
    config = {**dataclasses.asdict(hp), "plan": dataclasses.asdict(plan), **dataclasses.asdict(raw_model.config)}
    checkpointer = Checkpointer(hp.checkpoint_path)
    error, saved_unix = None, 0.0
    if rank == 0:  # a valid checkpoint is on disk before any rank's clock starts
        try:
            checkpointer.save(raw_model, {"config": config, "step": 0, "tokens": 0}, background=False)
            saved_unix = time.time()
        except CheckpointError as e:
            error = f"error: {e}"
    if not agree(error is None, device, world):
        fail(error or "error: the step-0 checkpoint could not be written; see rank 0's message")
    say(versions(device))
    say(f"plan: {plan.line()}")
    say(
        f"{world} x {device.type} | compile {hp.compile} | autocast {hp.autocast} | grad reduce {hp.grad_reduce} | "
        f"budget {budget_s:.0f} s, max_steps {hp.max_steps}"
    )
    if metrics is not None:
        metrics.truncate(0)
    if world > 1:
        warm_collectives(device)  # ends in a barrier: every rank starts its clock right after it
    return Run(
        hp=hp,
        plan=plan,
        budget_s=budget_s,
        rank=rank,
        world=world,
        device=device,
        raw_model=raw_model,
        model=model,
        optimizers=optimizers,
        loader=loader,
        val=val,
        config=config,
        checkpointer=checkpointer,
        metrics=metrics,
        stop_signal=stop_signal,
        step0_saved_unix=saved_unix,
        say=say,
    )


def init_device(hp, local_rank, world):
    """This rank's device (its GPU, or the CPU), and the process group across ranks."""
    cuda = hp.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        try:
            device = torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))
        except ValueError as e:
            fail(f"error: {e}")
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    if world > 1:
        timeout = datetime.timedelta(minutes=hp.collective_timeout_min)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, timeout=timeout)
    return device


def checked_inputs(hp, model_switches, rank, world, device, budget_s, say):
    """Data, validation, paths, the plan and the loader, agreed across ranks; nothing written yet. Returns hp with
    symlinked output paths resolved, and the rest."""
    try:  # data and paths may differ per rank (a node's staged copy)
        data, val = check_inputs(hp, rank, world)
        hp = check_outputs(hp, say)
        error = None
    except (ValueError, FileNotFoundError) as e:
        error = f"error: {e}"
    if not agree(error is None, device, world):
        fail(error or f"error: another rank's input checks failed (rank {rank} passed); see that rank's message")
    say(f"data: {data.source}")
    if hp.val_file and hp.data_dir and (twin := training_twin(hp.val_file, hp.data_dir)):
        say(f"warning: --val_file {hp.val_file} holds the same tokens as training file {twin}: it is not held out")
    try:  # the plan's one collective comes first, so a failure below cannot pair with another rank's collective
        plan = build_plan(hp, model_switches, device, world, budget_s, say)
        loader = BatchLoader(
            data.train,
            WindowSpec(hp.seq_len, doc_aligned=hp.doc_aligned, bos_id=data.bos_id, vocab_size=hp.vocab_size),
            plan.micro_batch,
            Deal(rank, world, seed=hp.seed),
            device=device,
        )
        metrics = lock_metrics(hp.metrics_path, say) if rank == 0 else None
        error = None
    except ValueError as e:
        error = f"error: {e}"
    if not agree(error is None, device, world):
        fail(error or f"error: another rank's checks failed (rank {rank} passed); see that rank's message")
    return hp, data, val, plan, loader, metrics


def build_model(hp, plan, model_switches, device, world):
    """(the plain model, what the loop calls: compiled per block and DDP-wrapped as configured, optimizers)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(hp.seed)
    shape = {k: getattr(plan, k) for k in ("n_layer", "n_head", "n_embd")}
    raw_model = get_model({"vocab_size": hp.vocab_size, "seq_len": hp.seq_len, **shape, **model_switches}).to(device)
    tied_head = raw_model.wte.weight if raw_model.config.tie_embeddings else None
    optimizers = build_optimizers(
        raw_model,
        use_muon=hp.optimizer == "muon",
        hidden_adamw_lr=hp.adamw_lr,
        muon_lr=hp.muon_lr,
        embed_lr=hp.embed_lr,
        head_lr=hp.head_lr,
        scalar_lr=hp.scalar_lr,
        muon_momentum=hp.muon_momentum_start,
        weight_decay=hp.weight_decay,
        tied_head=tied_head,
    )
    if hp.compile:
        torch._dynamo.config.optimize_ddp = False  # graphs are per block already
        # backward graphs compiled in the first forward, not lazily in the first backward: a compiler that fails
        # then fails before DDP's reducer expects a backward, and train.first_compiled_step can go on eagerly
        torch._functorch.config.force_non_lazy_backward_lowering = True
        raw_model.compile_per_block()
    model = raw_model
    if world > 1:
        model = DDP(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        if hp.grad_reduce == "bf16":
            model.register_comm_hook(None, bf16_grad_hook)
    return raw_model, model, optimizers


def resolve(hp, world):
    """The flags with every "auto" made concrete, once, for the run and for --dry_run: what each means on this machine
    (a dry run with --peak_tflops plans a CUDA device that is not here), or None where the plan decides."""
    cuda = hp.device == "cuda" or (hp.device != "cpu" and torch.cuda.is_available())
    kind = "cuda" if cuda or (hp.dry_run and isinstance(hp.peak_tflops, float) and hp.device != "cpu") else "cpu"
    home_data = "/home/data" if os.path.isdir("/home/data") else None
    data_dir = {"auto": home_data}.get(hp.data_dir, hp.data_dir)
    meaning = {
        "data_dir": home_data,
        "vocab_size": 32000 if data_dir or hp.dry_run else SYNTH_STATES,
        "metrics_path": os.path.join(os.path.dirname(os.path.abspath(hp.checkpoint_path)), "metrics.jsonl"),
        "val_file": None,
        "val_eval_tokens": hp.val_tokens if kind == "cuda" else 65536,
        "device": kind,
        "compile": kind == "cuda",
        "autocast": "bf16" if kind == "cuda" else "none",
        "tokens_per_param": TOKENS_PER_PARAM[kind],
        "auto_efficiency": AUTO_EFFICIENCY[kind],
        "world_size": world,
        "model": "auto",  # a plan.make_plan choice: the ladder picks
    }  # the rest (shape, micro-batch, tokens per step, accumulation, peak rate, memory): None, the plan decides
    given = dataclasses.asdict(hp)
    return dataclasses.replace(hp, **{k: meaning.get(k) if v == "auto" else v for k, v in given.items()})


def lock_metrics(path, say):
    """Open the metrics file for this run alone: a second run on the same path is an error, not mixed rows.
    Storage that refuses locks (ENOLCK, ENOSYS: older Lustre, some NFS) is not "in use": the run goes on unlocked."""
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            say(f"warning: {path} cannot be locked here ({e.strerror}); a second run on it would not be refused")
            return handle
        handle.close()
        raise ValueError(
            f"--metrics_path {path} is in use by another running train.py; give this run another "
            f"--checkpoint_path or --metrics_path"
        ) from None
    return handle


def cuda_index(local_rank, visible):
    """The GPU of this rank: LOCAL_RANK when every rank sees the node's GPUs (torchrun), 0 when a launcher gives
    each task one visible GPU (srun --gpus-per-task, CUDA_VISIBLE_DEVICES per rank)."""
    if visible == 1:
        return 0
    if not 0 <= local_rank < visible:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU: {visible} are visible to this process; launch one process per "
            f"GPU, or give each process one GPU"
        )
    return local_rank


def versions(device):
    """One line that says what ran: torch, and on CUDA the CUDA and NCCL versions, the GPU and its capability."""
    line = f"torch {torch.__version__}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "none"
        line += f" | CUDA {torch.version.cuda} | NCCL {nccl} | {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return line


def check_inputs(hp, rank, world):
    """Data, validation windows and paths: checked, nothing written."""
    data = load_token_data(hp.data_dir, hp.vocab_size, hp.seq_len, hp.val_tokens, hp.val_file)
    val = val_batches(data.val, hp.seq_len, hp.batch_size, rank, world, max_tokens=hp.val_eval_tokens)
    return data, val


def agree(ok, device, world):
    """True when every rank is ok: one rank's bad input (a node's staged data) stops all of them now."""
    if world == 1:
        return ok
    flag_tensor = torch.tensor([float(ok)], device=device)
    dist.all_reduce(flag_tensor, op=dist.ReduceOp.MIN)
    return flag_tensor.item() == 1.0


def build_plan(hp, model_switches, device, world, budget_s, say):
    """The run plan for budget_s seconds from this machine's measured speed, or from --peak_tflops/--world_size for a
    dry run. A plan that does not fit in memory is refused, one that fits too few steps for a schedule is said."""
    kind = device.type
    world = hp.world_size if hp.dry_run else world
    stated = hp.dry_run and hp.peak_tflops is not None
    rate = hp.peak_tflops * 1e12 if stated else agreed_matmul_rate(device, world if dist.is_initialized() else 1)
    if stated and hp.device_memory_gib is None:
        raise ValueError("--dry_run with --peak_tflops plans a device that is not here: give --device_memory_gib too")
    memory = hp.device_memory_gib * 2**30 if hp.device_memory_gib else device_memory(device)
    shape = {k: getattr(hp, k) for k in ("n_layer", "n_head", "n_embd") if getattr(hp, k) is not None}
    if shape and hp.shape_flags == "ignore":
        say(f"ignoring shape flags {shape} (--shape_flags ignore): --model {hp.model} decides")
        shape = {}
    if shape:
        given = model_config(shape)  # model.py's defaults fill the shape flags not given, without building a model
        shape = {"n_layer": given.n_layer, "n_head": given.n_head, "n_embd": given.n_embd, **model_switches}
    plan, table = make_plan(
        model=hp.model,
        shape=shape,
        switches=model_switches,
        tokens_per_param=hp.tokens_per_param,
        kind=kind,
        world_size=world,
        budget_s=budget_s,
        max_steps=hp.max_steps,
        seq_len=hp.seq_len,
        vocab_size=hp.vocab_size,
        batch_size=hp.batch_size,
        micro_batch=hp.micro_batch,
        batch_tokens=hp.batch_tokens,
        ramp_frac=hp.ramp_frac,
        matmul_rate=rate,
        efficiency=hp.auto_efficiency,
        memory_bytes=memory,
        bf16=hp.autocast == "bf16",
    )
    if table:
        say_ladder(plan, table, hp, rate, world, say)
    check_plan(plan, hp, memory, budget_s, say)
    return plan


def check_plan(plan, hp, memory, budget_s, say):
    """A plan that does not fit in memory, or fits no step in the budget, is refused (said, for a dry run); one that
    fits too few steps for a schedule is said."""
    if not plan.fits:
        message = (
            f"the plan needs {plan.memory_gib:.3g} GiB per device, more than the {memory / 2**30:.3g} GiB there is; "
            f"lower --micro_batch, --batch_size or --seq_len, or pick a smaller model"
        )
        if not hp.dry_run:
            raise ValueError(message)
        say(f"warning: {message}")
    if plan.steps == 0:
        message = (
            f"one step of {plan.tokens_per_step:,} tokens is forecast at {plan.step_s:.3g} s, longer than the whole "
            f"{budget_s:.3g} s budget; lower --batch_tokens or --batch_size, or raise --time_limit_min"
        )
        if not hp.dry_run:
            raise ValueError(message)
        say(f"warning: {message}")
    elif plan.steps < MIN_SCHEDULE_STEPS:
        say(
            f"warning: the plan fits {plan.steps} step(s) of {plan.step_s:.3g} s in the {budget_s:.3g} s budget "
            f"(--max_steps {hp.max_steps}): too few to warm up, hold and decay; the last step runs at the floor LR"
        )
    if hp.grad_accum_steps not in (None, plan.grad_accum_steps):
        say(f"--grad_accum_steps {hp.grad_accum_steps} is derived by the plan: {plan.grad_accum_steps}")


def say_ladder(plan, table, hp, rate, world, say):
    """What --model auto weighed: every ladder shape, the one picked marked."""
    say(
        f"model auto: {rate / 1e12:.3g} TFLOP/s x efficiency {plan.efficiency} x {world} ranks x "
        f"{hp.time_limit_min:g} min; want >= {hp.tokens_per_param:g} tokens per block param"
    )
    for row in table:
        say(
            f"  {'->' if row.model == plan.model else '  '} {row.model:>9}: {row.block_params / 1e6:8.2f}M block "
            f"params, {row.tokens / 1e9:9.4g}B tokens, {row.tokens_per_param:10.3g} tokens/param"
            f"{'' if row.fits else ', does not fit in memory'}"
        )


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


MIN_SCHEDULE_STEPS = 3  # a stable step, a decaying one and the floor-LR one


def launcher_env(env):
    """(rank, world size, local rank) from torchrun's variables, checked: without a launcher they are 0, 1, 0."""
    try:
        rank, world, local_rank = (int(env.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers; launch with torchrun") from None
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} do not fit; launch with torchrun")
    if world > 1 and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        raise ValueError(f"WORLD_SIZE={world} without MASTER_ADDR and MASTER_PORT: launch several ranks with torchrun")
    return rank, world, local_rank


def check_outputs(hp, say):
    """The checkpoint and metrics paths, checked against every way an output can destroy an input or land
    somewhere unexpected; returns hp with a symlinked output replaced by its target (written, and said so)."""
    folder = hp.data_dir or ""
    names = [os.path.join(folder, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])]
    inputs = {os.path.realpath(p): p for p in [*names, *([hp.val_file] if hp.val_file else [])]}
    resolved = {}
    for flag in ("checkpoint_path", "metrics_path"):
        path = getattr(hp, flag)
        if not path.strip():
            raise ValueError(f"--{flag} is empty; name a file")
        real = os.path.realpath(path)
        if real in inputs:
            raise ValueError(f"--{flag} {path} is the input file {inputs[real]}; writing it would destroy it")
        if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode) and not os.path.isdir(real):
            raise ValueError(f"--{flag} {path} is a device, pipe or socket, not a file a checkpoint can replace")
        if os.path.islink(path):
            say(f"--{flag} {path} is a symlink: writing its target, {real}")
        resolved[flag] = real if os.path.islink(path) else path
        check_writable(resolved[flag], flag)
    if os.path.realpath(resolved["checkpoint_path"]) == os.path.realpath(resolved["metrics_path"]):
        raise ValueError(
            f"--metrics_path and --checkpoint_path are both {resolved['metrics_path']}; each needs its own file"
        )
    return dataclasses.replace(hp, **resolved)


def slurm_end_time():
    """The SLURM job's end (unix seconds), or None outside SLURM or when it cannot be read."""
    if "SLURM_JOB_END_TIME" in os.environ:
        return float(os.environ["SLURM_JOB_END_TIME"])
    if "SLURM_JOB_ID" not in os.environ:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def training_budget(hp, rank, device, world, say):
    """Seconds of training: --time_limit_min, shrunk to end --slurm_reserve_s before the SLURM wall. Agreed."""
    budget = hp.time_limit_min * 60.0
    end = slurm_end_time() if rank == 0 else None
    if end is not None and end - time.time() - hp.slurm_reserve_s < budget:
        budget = max(end - time.time() - hp.slurm_reserve_s, 1.0)
        say(
            f"budget: {budget:.0f} s, not {hp.time_limit_min:g} min: the SLURM job ends in "
            f"{end - time.time():.0f} s and the final save and exit keep {hp.slurm_reserve_s:g} s"
        )
    agreed = torch.tensor([budget], device=device)
    if world > 1:
        dist.broadcast(agreed, src=0)
    return agreed.item()


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


def fail(message, code=2):
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)

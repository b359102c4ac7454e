"""Before the clock, in order: the process group (ranks.py), input checks agreed across ranks (paths.py for the files
written), the run plan, the model on its devices, the step-0 checkpoint, the SLURM-aware budget and one of each
collective. train.py calls launch() once; the loop then reads the Run it returns and nothing else.

Ranks agree before anything is written: every check that can differ per rank is followed by ranks.leave_together.
"""

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig, get_model, model_config
from headloss import compiled_head_loss, head_loss
from data import BatchLoader, TokenData, load_token_data, val_batches
from shards import Deal
from windows import Where, WindowSpec
from optimizers import optimizers_for_run
from plan import RunPlan, agreed_matmul_rate, device_memory, make_plan
from config import Resolved, resolve
from checkpoint import Checkpointer, check_room
from deadline import budget_until, training_deadline
from kernels import AttentionCall, AttentionChoice, agreed_attention, choose_attention, point_triton_at_ptxas
from kernels import EagerRuns, triton_version
from paths import PendingFile, check_outputs, lock_outputs, release_outputs, training_twin
from report import MetricsFile, carry_rows
from resume import Resumed, StateWriter, check_state_room, load_resumed, mismatch, resumed_state, state_fingerprint
from resume import state_root
from ranks import (
    bf16_grad_hook,
    cap_compile_workers,
    fail,
    init_device,
    launcher_env,
    leave_together,
    lower_backward_in_forward,
    StopSignals,
    sentence,
    torch_problem,
    versions,
    warm_collectives,
)


@dataclass(frozen=True)
class Run:
    """Everything the loop reads, built and checked before the clock; the loop changes none of it."""

    hp: Resolved  # no "auto" left (None where the plan decided)
    plan: RunPlan
    budget_s: float  # the plan's; the clock's is agreed from `deadline` right before it starts
    deadline: float  # unix seconds by which training ends (inf outside SLURM), the same on every rank
    rank: int
    world: int
    device: torch.device
    raw_model: torch.nn.Module
    model: torch.nn.Module  # raw_model, or its DDP wrapper
    loss_fn: object  # model(x, y, loss_fn=...)'s training loss: headloss.head_loss, compiled as configured
    attention: object  # kernels.AttentionChoice: its active() context holds for training and validation
    optimizers: list
    eager_runs: EagerRuns
    loader: BatchLoader
    val: list
    config: dict  # what checkpoints store: the hyperparameters, the plan and model.py's config
    checkpointer: Checkpointer
    metrics: MetricsFile | None  # rank 0's locked metrics file and its writer thread
    stop_signals: StopSignals
    say: object
    resumed: Resumed | None  # the training state this run goes on from (its weights and optimizers loaded)
    state_writer: StateWriter | None  # with --save_state: the training state's saves
    fingerprint: dict  # what a run resuming this one must share with it (resume.fingerprint)


def save_step_zero(checkpointer, raw_model, config, rank, device, world, resumed):
    """Rank 0 starts the first checkpoint (of step 0, or of the step a resumed run goes on from), written while the
    clock runs (checked_inputs made sure it fits; every later save waits for it); a save that cannot start ends every
    rank together, before the clock."""
    step, tokens = (resumed.meta["step"], resumed.meta["tokens"]) if resumed else (0, 0)
    error = None
    if rank == 0:
        try:
            checkpointer.save(
                raw_model, {"config": config, "step": step, "tokens": tokens, "weights": "plain"}, background=True
            )
        except Exception as e:
            error = sentence(e)
    refused_together(error, device, world, rank)


def refused_together(error, device, world, rank):
    """leave_together, and a refusal leaves nothing new: the lock files, folders and metrics file to be that this
    rank made are removed (paths.release_outputs)."""
    try:
        leave_together(error, device, world, rank)
    except SystemExit:
        release_outputs()
        raise


def launch(hp, model_switches, stop_signals, say):
    """Everything before the clock, in order: process group, checks, plan, model, step-0 save, warm collectives."""
    hp, rank, world, device, capability = this_rank(hp, say)
    deadline = training_deadline(hp, rank, device, world, say)
    budget_s = budget_until(deadline, hp)  # first: the plan is made for the budget the run gets
    resumed = resumed_state(hp, rank, world, device, say)  # a run that had finished ends here, nothing written
    inputs = checked_inputs(hp, model_switches, rank, world, device, capability, budget_s, say, resumed)
    hp, plan = inputs.hp, inputs.plan
    attention = agreed_attention(inputs.attention, device, world)
    for note in attention.notes:
        say(note)
    eager_runs = EagerRuns(say, fail_on_miss=hp.on_recompile == "fail")
    built = build_model(hp, plan, model_switches, device, world, eager_runs)
    # a gloo group of the state's own: a background save's collectives never meet the training's
    state_group = dist.new_group(backend="gloo") if world > 1 and (hp.save_state or resumed) else None
    if resumed:
        refused_together(load_resumed(resumed, built.raw_model, built.optimizers, state_group), device, world, rank)
    config = {**dataclasses.asdict(hp), "plan": dataclasses.asdict(plan), **dataclasses.asdict(built.raw_model.config)}
    checkpointer = Checkpointer(hp.checkpoint_path)
    save_step_zero(checkpointer, built.raw_model, config, rank, device, world, resumed)
    say(versions(device, f"{attention.label}, op {attention.op}"))
    say(f"plan: {plan.line()}")
    say(
        f"{world} x {device.type} | compile {hp.compile} | autocast {hp.autocast} | grad reduce {hp.grad_reduce} | "
        f"budget {budget_s:.0f} s, max_steps {hp.max_steps}"
    )
    metrics = open_metrics(inputs.metrics, hp.metrics_path, resumed)
    if world > 1:
        warm_collectives(device)  # ends in a barrier: every rank starts its clock right after it
    return Run(
        **built._asdict(),
        hp=hp,
        plan=plan,
        budget_s=budget_s,
        deadline=deadline,
        rank=rank,
        world=world,
        device=device,
        attention=attention,
        eager_runs=eager_runs,
        loader=inputs.loader,
        val=inputs.val,
        config=config,
        checkpointer=checkpointer,
        metrics=metrics,
        stop_signals=stop_signals,
        say=say,
        resumed=resumed,
        state_writer=StateWriter(hp.checkpoint_path, rank, state_group) if hp.save_state else None,
        fingerprint=inputs.fingerprint,
    )


def this_rank(hp, say):
    """The torch this runs on checked, this rank's place, the flags resolved for it, its device and process group,
    and on CUDA its compute capability, the ptxas Triton uses and the compile workers, set before anything compiles:
    (hp, rank, world, device, capability)."""
    if problem := torch_problem(torch.__version__):
        fail(f"error: {problem}")
    try:
        rank, world, local_rank = launcher_env(os.environ)
    except ValueError as e:
        fail(f"error: {e}")
    hp = resolve(hp, world)
    device = init_device(hp, rank, local_rank, world)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for line in (
        point_triton_at_ptxas(capability, triton_version(), os.environ),
        cap_compile_workers(os.environ, hp.compile),
    ):
        if line:
            say(line)
    return hp, rank, world, device, capability


def open_metrics(pending, path, resumed):
    """Rank 0's metrics file, a new one renamed in (never truncated: another name of the old one keeps its rows),
    holding a resumed run's earlier rows; None on the other ranks."""
    if pending is None:
        return None
    if resumed:
        carry_rows(path, pending.handle, resumed.meta["step"])
    return MetricsFile(pending.put_in_place())


class Inputs(NamedTuple):
    """What checked_inputs returns: checked and agreed across ranks, nothing written yet."""

    fingerprint: dict  # what a run resuming this one must share with it (resume.fingerprint)
    hp: Resolved  # with symlinked output paths resolved
    data: TokenData
    val: list
    plan: RunPlan
    loader: BatchLoader
    metrics: PendingFile | None  # rank 0's metrics file, to be put in place
    attention: AttentionChoice  # this rank's; launch agrees it across ranks


def checked_inputs(hp, model_switches, rank, world, device, capability, budget_s, say, resumed=None):
    """Data, validation, paths, the plan (a resumed run's is the one it was saved with), the attention backend (a
    forced one that fails its check is refused here) and the loader, agreed across ranks; nothing written yet."""
    try:  # data and paths may differ per rank (a node's staged copy, one rank's unreadable file)
        data, val = check_inputs(hp, rank, world)
        hp = check_outputs(hp, say)
        error = None
    except Exception as e:
        error = sentence(e)
    leave_together(error, device, world, rank)
    say(f"data: {data.source}")
    if hp.val_file and hp.data_dir and (twin := training_twin(hp.val_file, hp.data_dir)):
        say(f"warning: --val_file {hp.val_file} holds the same tokens as training file {twin}: it is not held out")
    try:  # the plan's one collective comes first, so a failure below cannot pair with another rank's collective
        plan = (
            RunPlan(**resumed.meta["plan"]) if resumed else build_plan(hp, model_switches, device, world, budget_s, say)
        )
        model = dataclasses.asdict(model_config(model_dict(hp, plan, model_switches)))
        fingerprint = state_fingerprint(hp, data.train, world, model)
        if resumed and (why := mismatch(resumed.meta["fingerprint"], fingerprint)):
            raise ValueError(f"--resume {resumed.folder}: {why}; resume with it, or start afresh with --resume none")
        dtype = torch.bfloat16 if hp.autocast == "bf16" else torch.float32
        head_dim = plan.n_embd // plan.n_head
        call = AttentionCall(plan.micro_batch, hp.seq_len, plan.n_head, head_dim, device, dtype, hp.compile)
        cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
        attention = choose_attention(hp.attention, call, capability, cudnn)
        loader = BatchLoader(
            data.train,
            WindowSpec(hp.seq_len, doc_aligned=hp.doc_aligned, bos_id=data.bos_id, vocab_size=hp.vocab_size),
            plan.micro_batch,
            Deal(rank, world, seed=hp.seed),
            device=device,
            start=Where(*resumed.meta["positions"][rank]) if resumed else None,
        )
        if rank == 0:  # each save writes a whole second file beside the last: a disk without room for both is said now
            check_room(hp.checkpoint_path, 4 * plan.n_params, "checkpoint_path")
            if hp.save_state:  # a snapshot's bytes: the weights and the optimizer state, and the tail EMA's copy
                check_state_room(state_root(hp.checkpoint_path), plan.snapshot_gib / 2 * 2**30 + 4 * plan.n_params)
        metrics = lock_outputs(hp, say) if rank == 0 else None
        error = None
    except Exception as e:
        error = sentence(e)
    refused_together(error, device, world, rank)
    return Inputs(fingerprint, hp, data, val, plan, loader, metrics, attention)


def check_inputs(hp, rank, world):
    """Data, validation windows and paths: checked, nothing written."""
    data = load_token_data(
        hp.data_dir, hp.vocab_size, hp.seq_len, hp.val_tokens, hp.val_file, hp.token_dtype, hp.bos_id
    )
    val = val_batches(data.val, hp.seq_len, hp.batch_size, rank, world, max_tokens=hp.val_eval_tokens)
    return data, val


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
        matmul_rate=rate,
        efficiency=hp.auto_efficiency,
        memory_bytes=memory,
        bf16=hp.autocast == "bf16",
        muon=hp.optimizer == "muon",
        tail_ema=hp.tail_ema > 0,
        snoo=hp.snoo_lr > 0,
        smoothing=hp.muon_smoothing > 0,
    )
    if table:
        say_ladder(plan, table, hp, rate, world, say)
    check_plan(plan, hp, memory, budget_s, say)
    return plan


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


MIN_SCHEDULE_STEPS = 3  # a stable step, a decaying one and the floor-LR one


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
        lower = "--batch_tokens" if hp.batch_tokens is not None else "--batch_size or --micro_batch"
        message = (
            f"one step of {plan.tokens_per_step:,} tokens is forecast at {plan.step_s:.3g} s, longer than the whole "
            f"{budget_s:.3g} s budget; lower {lower}, or raise --time_limit_min"
        )
        if not hp.dry_run:
            raise ValueError(message)
        say(f"warning: {message}")
    elif plan.steps < MIN_SCHEDULE_STEPS:
        say(
            f"warning: the plan fits {plan.steps} step(s) of {plan.step_s:.3g} s in the {budget_s:.3g} s budget "
            f"(--max_steps {hp.max_steps}): too few to warm up, hold and decay; the last step runs at the floor LR"
        )
    if hp.micro_batch is not None and plan.tokens_per_step > plan.asked_tokens_per_step:
        say(
            f"--micro_batch {hp.micro_batch}: {plan.tokens_per_step:,} tokens per step, not "
            f"{plan.asked_tokens_per_step:,}: a step is whole micro-batches of {plan.world_size} x {plan.micro_batch} "
            f"x {plan.seq_len} tokens"
        )
    if hp.grad_accum_steps not in (None, plan.grad_accum_steps):
        say(f"--grad_accum_steps {hp.grad_accum_steps} is derived by the plan: {plan.grad_accum_steps}")


class Model(NamedTuple):
    """What build_model returns, as the Run holds it."""

    raw_model: GPT
    model: torch.nn.Module  # what the loop calls: raw_model (compiled per block as configured), or its DDP wrapper
    loss_fn: object  # model(x, y, loss_fn=...)'s training loss: headloss.head_loss, compiled as configured
    optimizers: list


def model_dict(hp, plan, model_switches):
    """model.py's config of this run, whole: today's defaults for every switch not given, however many are."""
    shape = {k: getattr(plan, k) for k in ("n_layer", "n_head", "n_embd")}
    return {
        **dataclasses.asdict(GPTConfig()),
        "vocab_size": hp.vocab_size,
        "seq_len": hp.seq_len,
        **shape,
        **model_switches,
    }


def build_model(hp, plan, model_switches, device, world, eager_runs):
    """The model, compiled per block and DDP-wrapped as configured, its training loss and its optimizers."""
    if device.type == "cuda":
        allow_tf32_matmuls()
    torch.manual_seed(hp.seed)
    with torch.device(device):  # built where it trains: no CPU init of 529M parameters and copy (on CPU: as before)
        raw_model = get_model(model_dict(hp, plan, model_switches))
    tied_head = raw_model.wte.weight if raw_model.config.tie_embeddings else None
    optimizers = optimizers_for_run(raw_model, hp, tied_head)
    if hp.compile:
        torch._dynamo.config.optimize_ddp = False  # graphs are per block already
        lower_backward_in_forward()
        raw_model.compile_per_block()
        for part in raw_model.compiled_parts():  # what nn.Module.compile installed, called by part(...)
            part._compiled_call_impl = eager_runs.wrap(part._compiled_call_impl)
    loss_fn = compiled_head_loss(eager_runs.wrap) if hp.compile else head_loss
    if world == 1:
        return Model(raw_model, raw_model, loss_fn, optimizers)
    ddp = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if hp.grad_reduce == "bf16":
        ddp.register_comm_hook(None, bf16_grad_hook)
    return Model(raw_model, ddp, loss_fn, optimizers)


def allow_tf32_matmuls(matmul=torch.backends.cuda.matmul):
    """TF32 for float32 matmuls on CUDA (training runs bf16 under autocast; --autocast none and the attention check's
    float32 reference do not). The legacy setter, which sets torch's new per-backend flag with it and does not warn:
    torch >= 2.9's new form alone (matmul.fp32_precision = "tf32") leaves the legacy state behind, and inductor's
    readers of it then raise mid-compile (pytorch#166387, on 2.10 too); the cuDNN one warns and no cuDNN convolution or
    RNN runs here."""
    matmul.allow_tf32 = True


def dry_run(hp, model_switches, say):
    """The plan, printed: for this machine, or with --peak_tflops for a device that is not here."""
    hp = resolve(hp, int(os.environ.get("WORLD_SIZE", 1)))
    try:
        plan = build_plan(hp, model_switches, torch.device(hp.device), hp.world_size, hp.time_limit_min * 60, say)
    except ValueError as e:
        fail(f"error: {e}")
    say(plan.line())
    say(json.dumps(dataclasses.asdict(plan)))

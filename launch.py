"""Before the clock, in order: the process group (ranks.py), input checks agreed across ranks (paths.py for the files
written), the run plan, the model on its devices, the step-0 checkpoint, the SLURM-aware budget and one of each
collective. train.py calls launch() once; the loop then reads the Run it returns and nothing else.

Ranks agree before anything is written: every check that can differ per rank is followed by ranks.leave_together.
"""

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPTConfig, get_model, model_config
from headloss import compiled_head_loss, head_loss
from data import BatchLoader, load_token_data, val_batches
from shards import Deal
from synthetic import SYNTH_STATES
from windows import WindowSpec
from muon import build_optimizers
from plan import (
    AUTO_EFFICIENCY,
    RAMP_MIN_STEPS,
    TOKENS_PER_PARAM,
    RunPlan,
    agreed_matmul_rate,
    device_memory,
    make_plan,
)
from checkpoint import Checkpointer, check_room
from deadline import budget_until, training_deadline
from kernels import AttentionCall, agreed_attention, choose_attention, point_triton_at_ptxas, triton_version
from paths import check_outputs, lock_outputs, release_outputs, training_twin
from report import MetricsFile
from ranks import (
    bf16_grad_hook,
    cap_compile_workers,
    fail,
    init_device,
    launcher_env,
    leave_together,
    lower_backward_in_forward,
    sentence,
    torch_problem,
    versions,
    warm_collectives,
)


@dataclass
class Run:
    """Everything the loop reads, built and checked before the clock."""

    hp: object  # config.Hyperparameters, resolved: no "auto" left (None where the plan decided)
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
    eager_runs: "EagerRuns"
    loader: BatchLoader
    val: list
    config: dict  # what checkpoints store: the hyperparameters, the plan and model.py's config
    checkpointer: Checkpointer
    metrics: MetricsFile | None  # rank 0's locked metrics file and its writer thread
    stop_signal: list
    say: object
    data_gone: str | None = None  # this rank's DataChanged, carried to every rank by the next host sync


def save_step_zero(checkpointer, raw_model, config, rank, device, world):
    """Rank 0 starts the step-0 checkpoint, written while the clock runs (checked_inputs made sure it fits; every
    later save waits for it); a save that cannot start ends every rank together, before the clock."""
    error = None
    if rank == 0:
        try:
            checkpointer.save(
                raw_model, {"config": config, "step": 0, "tokens": 0, "weights": "plain"}, background=True
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


def launch(hp, model_switches, stop_signal, say):
    """Everything before the clock, in order: process group, checks, plan, model, step-0 save, warm collectives."""
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
        if line:  # before anything compiles
            say(line)
    deadline = training_deadline(hp, rank, device, world, say)
    budget_s = budget_until(deadline, hp)  # first: the plan is made for the budget the run gets
    hp, data, val, plan, loader, metrics, attention = checked_inputs(
        hp, model_switches, rank, world, device, capability, budget_s, say
    )
    attention = agreed_attention(attention, device, world)
    for note in attention.notes:
        say(note)
    eager_runs = EagerRuns(say, fail_on_miss=hp.on_recompile == "fail")
    raw_model, model, loss_fn, optimizers = build_model(hp, plan, model_switches, device, world, eager_runs)
    config = {**dataclasses.asdict(hp), "plan": dataclasses.asdict(plan), **dataclasses.asdict(raw_model.config)}
    checkpointer = Checkpointer(hp.checkpoint_path)
    save_step_zero(checkpointer, raw_model, config, rank, device, world)
    say(versions(device, f"{attention.label}, op {attention.op}"))
    say(f"plan: {plan.line()}")
    say(
        f"{world} x {device.type} | compile {hp.compile} | autocast {hp.autocast} | grad reduce {hp.grad_reduce} | "
        f"budget {budget_s:.0f} s, max_steps {hp.max_steps}"
    )
    if metrics is not None:  # a new file renamed in, never truncated: another name of the old one keeps its rows
        metrics = MetricsFile(metrics.put_in_place())
    if world > 1:
        warm_collectives(device)  # ends in a barrier: every rank starts its clock right after it
    return Run(
        hp=hp,
        plan=plan,
        budget_s=budget_s,
        deadline=deadline,
        rank=rank,
        world=world,
        device=device,
        raw_model=raw_model,
        model=model,
        loss_fn=loss_fn,
        attention=attention,
        optimizers=optimizers,
        eager_runs=eager_runs,
        loader=loader,
        val=val,
        config=config,
        checkpointer=checkpointer,
        metrics=metrics,
        stop_signal=stop_signal,
        say=say,
    )


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
        "attention": "auto",  # a kernels.choose_attention choice, on the device
    }  # the rest (shape, micro-batch, tokens per step, accumulation, peak rate, memory): None, the plan decides
    given = dataclasses.asdict(hp)
    return dataclasses.replace(hp, **{k: meaning.get(k) if v == "auto" else v for k, v in given.items()})


def checked_inputs(hp, model_switches, rank, world, device, capability, budget_s, say):
    """Data, validation, paths, the plan, the attention backend (a forced one that fails its check is refused here)
    and the loader, agreed across ranks; nothing written yet. Returns hp with symlinked output paths resolved, and the
    rest."""
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
        plan = build_plan(hp, model_switches, device, world, budget_s, say)
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
        )
        if rank == 0:  # each save writes a whole second file beside the last: a disk without room for both is said now
            check_room(hp.checkpoint_path, 4 * plan.n_params, "checkpoint_path")
        metrics = lock_outputs(hp, say) if rank == 0 else None
        error = None
    except Exception as e:
        error = sentence(e)
    refused_together(error, device, world, rank)
    return hp, data, val, plan, loader, metrics, attention


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
        ramp_frac=hp.ramp_frac,
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
    if hp.ramp_frac and hp.batch_tokens is None and not plan.ramp_frac:
        say(
            f"--ramp_frac {hp.ramp_frac:g} is off: --max_steps {hp.max_steps} leaves too few steps to ramp the batch "
            f"over (a ramp needs {RAMP_MIN_STEPS} planned); the plan's batch throughout"
        )
    if hp.grad_accum_steps not in (None, plan.grad_accum_steps):
        say(f"--grad_accum_steps {hp.grad_accum_steps} is derived by the plan: {plan.grad_accum_steps}")


def build_model(hp, plan, model_switches, device, world, eager_runs):
    """(the plain model, what the loop calls: compiled per block and DDP-wrapped as configured, its loss_fn,
    optimizers)."""
    if device.type == "cuda":
        allow_tf32_matmuls()
    torch.manual_seed(hp.seed)
    shape = {k: getattr(plan, k) for k in ("n_layer", "n_head", "n_embd")}
    # from a whole config: today's defaults for every switch not given, however many are (model.model_config)
    config = {**dataclasses.asdict(GPTConfig()), "vocab_size": hp.vocab_size, "seq_len": hp.seq_len}
    with torch.device(device):  # built where it trains: no CPU init of 529M parameters and copy (on CPU: as before)
        raw_model = get_model({**config, **shape, **model_switches})
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
        muon_weight_decay=hp.muon_weight_decay,
        adam_weight_decay=hp.adam_weight_decay,
        ns_coeffs=hp.ns_coeffs,
        normuon_beta2=hp.normuon_beta2,
        update_smoothing=hp.muon_smoothing,
        snoo=(hp.snoo_lr, hp.snoo_momentum, hp.snoo_every) if hp.snoo_lr else None,
        tied_head=tied_head,
    )
    if hp.compile:
        torch._dynamo.config.optimize_ddp = False  # graphs are per block already
        lower_backward_in_forward()
        raw_model.compile_per_block()
        for part in raw_model.compiled_parts():  # what nn.Module.compile installed, called by part(...)
            part._compiled_call_impl = eager_runs.wrap(part._compiled_call_impl)
    loss_fn = compiled_head_loss(eager_runs.wrap) if hp.compile else head_loss
    model = raw_model
    if world > 1:
        model = DDP(
            raw_model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        if hp.grad_reduce == "bf16":
            model.register_comm_hook(None, bf16_grad_hook)
    return raw_model, model, loss_fn, optimizers


def allow_tf32_matmuls(matmul=torch.backends.cuda.matmul):
    """TF32 for float32 matmuls on CUDA (training runs bf16 under autocast; --autocast none and the attention check's
    float32 reference do not). The legacy setter, which sets torch's new per-backend flag with it and does not warn:
    torch >= 2.9's new form alone (matmul.fp32_precision = "tf32") leaves the legacy state behind, and inductor's
    readers of it then raise mid-compile (pytorch#166387, on 2.10 too); the cuDNN one warns and no cuDNN convolution or
    RNN runs here."""
    matmul.allow_tf32 = True


class EagerRuns:
    """After step 0 the stance is fail_on_recompile: a compiled region whose guards miss (a new input shape, a changed
    guard) raises before it runs anything; that call then runs eagerly (2-3x slower, but no recompile on the clock),
    said once and counted for the summary. With --on_recompile fail the error stands."""

    def __init__(self, say, fail_on_miss):
        self.say, self.fail_on_miss, self.count = say, fail_on_miss, 0

    def wrap(self, compiled):
        def call(*args, **kwargs):
            try:
                return compiled(*args, **kwargs)
            except RuntimeError as e:
                if self.fail_on_miss or "Detected recompile" not in str(e):
                    raise
                miss = " ".join(str(e).split())[:300]
            self.count += 1
            if self.count == 1:
                self.say(f"warning: a compiled graph's guards missed after step 0; it runs eagerly, slower ({miss})")
            with torch.compiler.set_stance("force_eager"):
                return compiled(*args, **kwargs)

        return call


def dry_run(hp, model_switches, say):
    """The plan, printed: for this machine, or with --peak_tflops for a device that is not here."""
    hp = resolve(hp, int(os.environ.get("WORLD_SIZE", 1)))
    try:
        plan = build_plan(hp, model_switches, torch.device(hp.device), hp.world_size, hp.time_limit_min * 60, say)
    except ValueError as e:
        fail(f"error: {e}")
    say(plan.line())
    say(json.dumps(dataclasses.asdict(plan)))

"""The run's configuration: one dataclass of hyperparameters, its flags (generated from the fields, with the
organizers' names verbatim), and the checks every value passes before anything runs. train.py imports it first,
as nanoGPT keeps its configurator apart."""

import argparse
import dataclasses
import math
import operator
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, NoReturn, TypeAlias, TypeVar, cast

import torch

from model import GPTConfig
from plan import AUTO_EFFICIENCY, TOKENS_PER_PARAM, shape_config
from synthetic import SYNTH_STATES


def flag(default, help, kind=None, choices=None, at_least=None, above=None, below=None, at_most=None):
    """A hyperparameter, its --help line and the values it may take (check_flags): choices, or a finite number within
    the bounds given. kind converts a flag whose default is "auto"."""
    bounds = {"at least": at_least, "above": above, "below": below, "at most": at_most}
    meta = {
        "help": help,
        "kind": kind,
        "choices": choices,
        "bounds": {k: v for k, v in bounds.items() if v is not None},
    }
    return field(default=default, metadata=meta)


POSITIVE = {"at_least": 1}  # counts: sequences, steps, layers
FRACTION = {"at_least": 0.0, "at_most": 1.0}
LR = {"at_least": 0.0}  # finite; huge ones stay allowed: a diverging run is an experiment (tests make one)


# --save_state auto: a budget this long (minutes) saves the training state; a shorter one (the event's 10 minutes)
# writes only its checkpoint: a state is ~2.6x its bytes (weights and optimizer moments), seconds a save on NFS
STATE_FROM_MIN = 30.0

Auto = Literal["auto"]
# the type a derived flag adds to its own: Auto as parsed (the flag not given), nothing once resolve() made it concrete
Derived = TypeVar("Derived")


@dataclass(frozen=True)
class Hyperparameters(Generic[Derived]):
    """The flags. As parsed (Parsed), a derived flag not given holds "auto"; resolve() returns them with every "auto"
    made concrete in the annotated type (None: the plan decides), once, for the run and for --dry_run alike
    (Resolved)."""

    # --- the organizers' flag names, kept verbatim ---
    data_dir: str | None | Derived = flag(
        "auto", "token folder (chunk_*.bin or *_train_*.bin); auto: /home/data if present, else synthetic data"
    )
    checkpoint_path: str = flag("checkpoint.pt", "written at start, every --save_every_min, on SIGTERM and at the end")
    seq_len: int = flag(1024, "training window in tokens", **POSITIVE)
    vocab_size: int | Derived = flag(
        "auto", "auto: 32000 for token files, 1024 for the synthetic data", int, at_least=2, at_most=2**32
    )
    n_layer: int | None | Derived = flag(
        "auto", "shape flag; auto: from --model (given shape flags win, see --shape_flags)", int, **POSITIVE
    )
    n_head: int | None | Derived = flag("auto", "shape flag; auto: from --model", int, **POSITIVE)
    n_embd: int | None | Derived = flag("auto", "shape flag; auto: from --model", int, **POSITIVE)
    batch_size: int = flag(8, "the floor of the micro-batch (sequences per device per forward)", **POSITIVE)
    grad_accum_steps: int | None | Derived = flag(
        "auto", "derived by the plan from tokens per step; a given value is ignored", int, **POSITIVE
    )
    max_steps: int = flag(1_000_000, "never exceeded; tokens per step grow so the budget fits in 90% of it", **POSITIVE)
    time_limit_min: float = flag(10.0, "the training budget in minutes, from the first forward pass", above=0.0)
    # --- the run plan (plan.py) ---
    model: str = flag("auto", "a plan.LADDER name; auto: the largest trained --tokens_per_param tokens per param")
    shape_flags: str = flag(
        "win", "win: --n_layer/--n_head/--n_embd override --model; ignore: --model decides", choices=("win", "ignore")
    )
    tokens_per_param: float | Derived = flag(
        "auto", f"what --model auto wants; auto: per device {TOKENS_PER_PARAM}", float, above=0.0
    )
    auto_efficiency: float | Derived = flag(
        "auto", f"step speed / matmul rate; auto: per device {AUTO_EFFICIENCY}", float, above=0.0, at_most=1.0
    )
    batch_tokens: int | None | Derived = flag(
        "auto", "global tokens per step; auto: the recipe's minimum, or more (--max_steps)", int, **POSITIVE
    )
    micro_batch: int | None | Derived = flag(
        "auto", "sequences per device per forward; auto: as many as memory allows", int, **POSITIVE
    )
    dry_run: bool = flag(False, "print the plan and exit before any forward pass")
    world_size: int | Derived = flag(
        "auto", "with --dry_run: plan for this many devices; auto: this launch's", int, **POSITIVE
    )
    peak_tflops: float | None | Derived = flag(
        "auto", "bf16 peak per device, for MFU (and the rate a dry run plans with)", float, above=0.0
    )
    device_memory_gib: float | None | Derived = flag(
        "auto", "per-device memory to plan with; auto: this device's", float, above=0.0
    )
    # --- data and evaluation ---
    metrics_path: str | Derived = flag("auto", "JSON-lines metrics; auto: metrics.jsonl beside the checkpoint")
    val_file: str | None | Derived = flag(
        "auto", "validation token file; auto: the last --val_tokens of the last data file"
    )
    val_tokens: int = flag(
        1_048_576, "size of the held-out validation range (the same tokens on every run)", at_least=0, at_most=1 << 27
    )
    val_eval_tokens: int | Derived = flag(
        "auto", "validation tokens scored; auto: all on CUDA, 65536 on CPU", int, **POSITIVE
    )
    val_every_min: float = flag(
        0.0, "periodic validation until the decay, planned into the budget; 0: final only", at_least=0.0
    )
    save_every_min: float = flag(2.5, "background checkpoint cadence; 0: only at start and end", at_least=0.0)
    # --- runs longer than one job (resume.py) ---
    resume: str = flag(
        "auto",
        "auto: go on from the training state beside --checkpoint_path when there is one (said either way); none: a "
        "fresh run; or the checkpoint path (or .state folder) of the run to go on from",
    )
    save_state: bool | Derived = flag(
        "auto",
        f"with every save, the training state beside the checkpoint (CHECKPOINT.state/: weights, optimizer state, the "
        f"loop's place), so a later job can --resume; auto: on with --budget_spans_jobs or a --time_limit_min of "
        f"{STATE_FROM_MIN:g} or more",
        bool,
    )
    budget_spans_jobs: bool = flag(
        False,
        "--time_limit_min is the run's budget over several jobs: a job whose SLURM wall comes first trains up to it, "
        "saves the state and exits 0 (stop reason wall), and the next (--resume) goes on; off: the wall shrinks it",
    )
    doc_aligned: bool = flag(False, "start every window at a BOS token (needs BOS-marked data)")
    token_dtype: str = flag(
        "uint16", "ids of headerless token files (llm.c's headered shards name their own)", choices=("uint16", "uint32")
    )
    bos_id: int | None | Derived = flag(
        "auto",
        "the document marker (--doc_aligned, the BOS check); auto: the format's: 1 in raw files, 50256 (GPT-2's "
        "<|endoftext|>) in llm.c's uint16 shards, 128000 (Llama-3's <|begin_of_text|>) in its uint32 ones",
        int,
        at_least=0,
    )
    # --- schedule and optimizer ---
    schedule: str = flag(
        "wsd", "wsd (warmup, stable, linear decay) or cosine (the starter's, for baselines)", choices=("wsd", "cosine")
    )
    progress_by: str = flag(
        "clock", "clock: elapsed / budget; steps: step / max_steps (the starter's way)", choices=("clock", "steps")
    )
    warmup_frac: float = flag(0.0, "fraction of the run in linear LR warmup (Muon needs none)", at_least=0.0, below=1.0)
    # mnGPT medium (16 x 1024) "longer cooldown": -30 s; here vs 0.4 +0.041, a tie; BENCHMARKS "The record's settings"
    decay_frac: float = flag(
        0.7, "WSD: fraction of the run in the final linear decay (0.7: the 16 x 1024 record's)", above=0.0, at_most=1.0
    )
    # mnGPT short track: -1.2 s; here vs 0: -0.024, a tie: the record's; BENCHMARKS "The record's settings"
    min_lr_frac: float = flag(
        0.15,
        "the LR floor the decay ends at, as a fraction of each group's LR (0.15: the short-track record's)",
        **FRACTION,
    )
    # mnGPT optimization track #45-#46: -30 of 2,750 steps; here +0.003, a tie: off; BENCHMARKS "Tail EMA"
    tail_ema: float = flag(
        0.0, "blend of the weights' tail EMA into the final checkpoint (0.6: the record's); 0: off", **FRACTION
    )
    # the record's rule: the schedule's timescale lr / |dlr/dt| at its end, 0.15 x 0.7 / 0.85 of the run (tailema.py)
    tail_ema_horizon: float = flag(
        0.12,
        "the tail EMA's time constant, as a fraction of the run; it starts 5 of them before the end",
        above=0.0,
        at_most=0.2,
    )
    optimizer: str = flag(
        "muon", "muon: Muon for hidden matrices + AdamW; adamw: AdamW for everything", choices=("muon", "adamw")
    )
    # mnGPT short track's 0.05, halved: here better on 3/3 seeds at widths 128-384; BENCHMARKS "LRs across widths"
    muon_lr: float = flag(
        0.025, "Muon LR of the hidden matrices (the CPU's best at widths 128-384, BENCHMARKS.md)", **LR
    )
    adamw_lr: float = flag(3e-3, "AdamW LR of the hidden matrices with --optimizer adamw", **LR)
    # mnGPT short track; here x0.5 and x2 within 0.013 at widths 128-384, flat: kept; BENCHMARKS "LRs across widths"
    embed_lr: float = flag(0.6, "AdamW LR of the embedding tables", **LR)
    head_lr: float = flag(0.008, "AdamW LR of the output head (and of a tied embedding)", **LR)
    scalar_lr: float = flag(0.04, "AdamW LR of gains and scalars", **LR)
    # Malladi et al. 2022 (arXiv:2205.10287); here at 4x the batch none +0.24-0.39; BENCHMARKS "The batch rule's scope"
    lr_rule: str = flag(
        "sqrt",
        "sqrt: every LR x sqrt(tokens per step / the recipe's minimum) when the batch is larger (BENCHMARKS.md, "
        "the step cap); sqrt_adam: the AdamW groups' only, Muon's as given; none: the LRs as given",
        choices=("none", "sqrt", "sqrt_adam"),
    )
    # mnGPT medium (16 x 1024): -72 s; here -0.013, a tie: the record's; BENCHMARKS "The record's settings"
    muon_weight_decay: float = flag(
        1.2, "Muon's weight decay, times the LR, cautious (only where update and weight agree in sign)", **LR
    )
    # mnGPT medium's Adam groups; here measured together with Muon's; BENCHMARKS "The record's settings"
    adam_weight_decay: float = flag(0.005, "the same on the AdamW embedding, head and hidden tables", **LR)
    # Amsel et al. 2025 (arXiv:2505.16932), mnGPT -24 s; here +0.021, a tie: adopted; BENCHMARKS "The record's settings"
    ns_coeffs: str = flag(
        "polar_express",
        "Newton-Schulz polynomials: quintic (one fixed, Keller Jordan's) or polar_express (one per iteration, "
        "Amsel et al. 2025)",
        choices=("quintic", "polar_express"),
    )
    # Li et al. 2025 (arXiv:2510.05491), mnGPT medium #18; here -0.022, a tie the record decides; BENCHMARKS "NorMuon"
    normuon_beta2: float = flag(
        0.95,
        "NorMuon: each neuron's Muon update divided by the root of an EMA of its mean square with this beta2, the "
        "update's norm kept (0: off, plain Muon; 0.95: the record's)",
        at_least=0.0,
        below=1.0,
    )
    # update smoothing: mnGPT medium #13 (0.5 -> 0.2: -80/5,690 steps), #14 (0.2, with Snoo: -100). Here: -0.0033, a tie
    muon_smoothing: float = flag(
        0.2,
        "an EMA of Muon's orthogonalised update replaces it, this much of the old kept (0: off; 0.2: the record's)",
        at_least=0.0,
        below=1.0,
    )
    # Snoo: mnGPT medium #12 (-60 steps of ~5,700), #14 (with smoothing: -100/5,690). Here: -0.0087 (3 seeds, a tie)
    snoo_lr: float = flag(
        0.68,
        "Snoo: every --snoo_every steps the weights' move since the last outer step taken as a Nesterov SGD step from "
        "the slow weights at this LR (0: off; 0.68: the record's)",
        at_least=0.0,
    )
    snoo_momentum: float = flag(0.37, "Snoo's Nesterov momentum (0.37: the record's)", at_least=0.0, below=1.0)
    snoo_every: int = flag(28, "inner optimizer steps between Snoo's outer steps (28: the record's)", **POSITIVE)
    muon_momentum_start: float = flag(
        0.85, "Muon momentum at the start (early gradients are noisy)", at_least=0.0, below=1.0
    )
    muon_momentum: float = flag(0.95, "Muon momentum after --momentum_warmup_frac", at_least=0.0, below=1.0)
    momentum_warmup_frac: float = flag(0.15, "fraction of the run over which Muon momentum warms up", **FRACTION)
    # --- device and runtime ---
    device: str = flag("auto", "auto (CUDA if present), cpu or cuda", choices=("auto", "cpu", "cuda"))
    compile: bool | Derived = flag("auto", "compile each transformer block; auto: on CUDA only", bool)
    autocast: str = flag("auto", "bf16 or none; auto: bf16 on CUDA, none on CPU", choices=("auto", "bf16", "none"))
    # torch 2.9-2.10 prefer cuDNN on sm_90 and sm_100 only: a B300 got FlashAttention-2 at ~half its speed (kernels.py)
    attention: str = flag(
        "auto",
        "SDPA backend: auto (torch's pick; on compute capability 10.x cuDNN first, then down the list to the first "
        "that agrees with math) or one forced: cudnn, flash, efficient, math (checked first: one that fails is an "
        "error)",
        choices=("auto", "cudnn", "flash", "efficient", "math"),
    )
    grad_reduce: str = flag(
        "bf16", "dtype of the gradient all-reduce across ranks: bf16 (half the bytes) or fp32", choices=("bf16", "fp32")
    )
    collective_timeout_min: float = flag(  # below seconds, the process-group set-up itself times out
        5.0, "a rank silent this long in a collective ends the job (> compile skew)", at_least=0.05
    )
    slurm_reserve_s: float = flag(
        60.0, "under SLURM, seconds kept after training for the final save and exit", at_least=0.0
    )
    on_recompile: str = flag(
        "eager",
        "after step 0, a compiled graph whose guards miss: eager (run it eagerly, counted as eager_runs in the "
        "summary) or fail (an error: bench/gpu_check.sh proves that none happens)",
        choices=("eager", "fail"),
    )
    profile: bool = flag(
        False,
        "record optimizer steps 3-5 with torch.profiler (CPU, and CUDA on a GPU) on rank 0: a Chrome trace beside the "
        "metrics (metrics.trace.json; Perfetto opens it) and the top ops by self time; its cost is counted as paused",
    )
    seed: int = flag(0, "seed of the weights and of the data order", at_least=0, below=2**32)
    log_every_s: float = flag(
        1.0, "host-sync cadence: clock check, loss read, stop decision, metrics row", at_least=0.0
    )


Parsed: TypeAlias = "Hyperparameters[Auto]"
Resolved: TypeAlias = "Hyperparameters[NoReturn]"


def resolve(hp: Parsed, world: int) -> Resolved:
    """The flags with every "auto" made concrete, once, for the run and for --dry_run: what each means on this machine
    (a dry run with --peak_tflops plans a CUDA device that is not here), or None where the plan decides."""
    cuda = hp.device == "cuda" or (hp.device != "cpu" and torch.cuda.is_available())
    kind = "cuda" if cuda or (hp.dry_run and isinstance(hp.peak_tflops, float) and hp.device != "cpu") else "cpu"
    home_data = "/home/data" if os.path.isdir("/home/data") else None
    data_dir = home_data if hp.data_dir == "auto" else hp.data_dir
    meaning: dict[str, object] = {
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
        "resume": "auto",  # resume.find's: the state beside the checkpoint, if there is one
        "save_state": hp.budget_spans_jobs or hp.time_limit_min >= STATE_FROM_MIN,
    }  # the rest (shape, micro-batch, tokens per step, accumulation, peak rate, memory): None, the plan decides
    given = dataclasses.asdict(hp)
    values: dict[str, Any] = {k: meaning.get(k) if v == "auto" else v for k, v in given.items()}
    return cast(Resolved, Hyperparameters(**values))


class FlagParser(argparse.ArgumentParser):
    """argparse whose error (a value it cannot read: --seq_len abc, --compile maybe) is one sentence and exit 2, like
    check_flags's, not the whole usage first."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


def truth(text):
    """A boolean flag's value in the nanoGPT idiom (--compile False): true/false, 1/0 or yes/no, in any case."""
    if text.lower() not in TRUE_WORDS + FALSE_WORDS:
        raise argparse.ArgumentTypeError(f"expected true/false, 1/0 or yes/no, got {text!r}")
    return text.lower() in TRUE_WORDS


def add_boolean(parser, name, default, help_text):
    """--name (true), --no-name (false), or --name VALUE / --name=VALUE (truth): a value after a boolean flag is read,
    never left in the unknown flags while the flag turns true."""
    convert = (lambda s: s if s == "auto" else truth(s)) if default == "auto" else truth
    parser.add_argument(
        f"--{name}", nargs="?", const=True, default=default, type=convert, metavar="true|false", help=help_text
    )
    parser.add_argument(f"--no-{name}", dest=name, action="store_false", default=default, help=argparse.SUPPRESS)


# experiments that lost, retired: given, each is one sentence naming what replaced it (exit 2), never silently ignored
RETIRED = {
    "mtp": 'multi-token prediction lost at fixed steps (worse on 3 of 3 seeds; BENCHMARKS.md, "Multi-token '
    'prediction"): training scores the next token',
    "ramp_frac": "the batch ramp lost to a constant batch (BENCHMARKS.md, \"The recipe under the organizers' step "
    'cap"): the forced batch runs from the first step, its accumulation replanned by the clock',
}


class Flags(NamedTuple):
    hp: Parsed
    model_switches: dict  # the model.py switches given
    unknown: list  # flags no field or switch knows


def parse_args(argv=None):
    """The Flags: the dataclass's, plus one per model.py switch (default: model.py's own); a RETIRED flag is an
    error naming what replaced it."""
    # no prefix matching: an unknown --warmup must be ignored, not read as --warmup_frac
    parser = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    for arg in sys.argv[1:] if argv is None else argv:
        name = arg.partition("=")[0].removeprefix("--").removeprefix("no-")
        if arg.startswith("--") and name in RETIRED:
            parser.error(f"--{name} was retired: {RETIRED[name]}")
    for f in dataclasses.fields(Hyperparameters):
        kind, help_text = (
            f.metadata["kind"] or (f.type if f.type in (int, float, bool) else str),
            f"{f.metadata['help']} (default: {f.default})".replace("%", "%%"),
        )
        if kind is bool:
            add_boolean(parser, f.name, f.default, help_text)
            continue
        convert = (lambda k: lambda s: s if s == "auto" else k(s))(kind) if f.default == "auto" else kind
        parser.add_argument(f"--{f.name}", type=convert, default=f.default, help=help_text)
    ours = {f.name for f in dataclasses.fields(Hyperparameters)}
    switches = [f for f in dataclasses.fields(GPTConfig) if f.name not in ours]
    for f in switches:
        help_text = f"model.py switch (default: {f.default})"
        if f.type is bool:
            add_boolean(parser, f.name, None, help_text)
        else:
            parser.add_argument(f"--{f.name}", type=f.type, default=None, help=help_text)
    namespace, unknown = parser.parse_known_args(argv)
    args = vars(namespace)
    model_switches = {f.name: value for f in switches if (value := args.pop(f.name)) is not None}
    return Flags(Hyperparameters(**args), model_switches, unknown)


BOUND_TESTS = {"at least": operator.ge, "above": operator.gt, "below": operator.lt, "at most": operator.le}
# model.py's numeric switches, each a finite number in these bounds: said here with the flag's name before anything
# runs (GPT checks a config dict's shape values too). gate_lr_mult reaches an optimizer, so a negative or NaN value
# would train silently wrong; an infinite rope_base would silently turn every rotation but one off
SWITCH_BOUNDS = {
    "mlp_ratio": {"at least": 1},
    "rope_base": {"above": 1},
    "logit_softcap": {"at least": 0},
    "bigram_mult": {"at least": 0},
    "untie_at": {"at least": 0, "below": 1},
    "gate_lr_mult": {"at least": 0},
}


def check_range(name, value, bounds):
    if not math.isfinite(value):
        raise ValueError(f"--{name} must be a finite number, got {value}")
    for words, bound in bounds.items():
        if not BOUND_TESTS[words](value, bound):
            raise ValueError(f"--{name} must be {words} {bound}, got {value}")


def check_flags(hp, model_switches=None):
    """Flag values a user can get wrong, as one sentence each; the same on every rank, so no collective.
    model_switches: the model.py switches given (parse_args), ranged by SWITCH_BOUNDS."""
    for f in dataclasses.fields(hp):
        value, choices, bounds = getattr(hp, f.name), f.metadata["choices"], f.metadata["bounds"]
        if choices and value not in choices:
            raise ValueError(f"--{f.name} must be one of {', '.join(choices)}, got {value!r}")
        if bounds and value != "auto":
            check_range(f.name, value, bounds)
    for name, value in (model_switches or {}).items():
        if name in SWITCH_BOUNDS:
            check_range(name, value, SWITCH_BOUNDS[name])
    if hp.schedule == "wsd" and hp.warmup_frac + hp.decay_frac > 1.0:
        raise ValueError(
            f"--warmup_frac {hp.warmup_frac} leaves no room for the decay: with wsd it must be at most 1 - --decay_frac"
        )
    if hp.budget_spans_jobs and hp.save_state is False:
        raise ValueError("--budget_spans_jobs needs the training state to go on from: drop --save_state false")
    if hp.model != "auto":  # checked even when the shape flags override it: a typo is said, not hidden
        shape_config(hp.model)
    if hp.device == "cuda" and not torch.cuda.is_available() and not hp.dry_run:
        raise ValueError("--device cuda was given but no CUDA device is visible")


def overridden_flags(hp):
    """A sentence for each flag given that other flags leave unused: said before the clock, never silently dropped."""
    given = {f.name for f in dataclasses.fields(hp) if getattr(hp, f.name) != f.default}
    shape = sorted({"n_layer", "n_head", "n_embd"} & given)
    unused = {  # flag: why it is unused (when it is)
        "model": shape and hp.shape_flags == "win" and f"the shape flags ({', '.join(shape)}) decide the shape",
        "tokens_per_param": (shape and hp.shape_flags == "win" or hp.model != "auto") and "no --model auto to guide",
        "adamw_lr": hp.optimizer == "muon" and "--optimizer muon trains the hidden matrices with --muon_lr",
        **dict.fromkeys(
            ("muon_lr", "muon_momentum", "muon_momentum_start", "momentum_warmup_frac"),
            hp.optimizer == "adamw" and "--optimizer adamw uses no Muon",
        ),
        "world_size": not hp.dry_run and "it plans for another machine with --dry_run only; this launch's ranks train",
        "tail_ema_horizon": not hp.tail_ema and "--tail_ema 0 keeps no average",
        **dict.fromkeys(("snoo_momentum", "snoo_every"), not hp.snoo_lr and "--snoo_lr 0 takes no outer steps"),
    }
    return [f"--{name} {getattr(hp, name)} is not used: {why}" for name, why in unused.items() if name in given and why]

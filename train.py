"""Time-boxed GPT pretraining: one flat loop, keyed to the wall clock.

    python train.py                                  # 1 process: CUDA if present, else CPU
    torchrun --nproc_per_node=8 train.py --data_dir /home/data/
    sbatch submit_slurm.sh                           # 4 nodes x 8 GPUs

The schedule is a function of progress = max(elapsed / budget, step / max_steps), so whichever
limit the launcher's flags make binding, warmup, stable and decay all happen and the last step
runs at the floor LR. The clock starts right before the first forward pass (compile included).
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from model import GPTConfig, get_model
from data import SYNTH_STATES, BatchLoader, load_token_data, val_batches
from muon import build_optimizers
from autosize import choose_shape, peak_flops, shape_config
from checkpoint import Checkpointer, check_writable, cpu_state_dict, save_checkpoint


@dataclass
class Hyperparameters:
    # --- the organizers' flag names, kept verbatim ---
    data_dir: Optional[str] = None  # None: /home/data if it exists, else embedded synthetic data
    checkpoint_path: str = "checkpoint.pt"
    seq_len: int = 1024
    vocab_size: Optional[int] = None  # None: 32000 for token files, 1024 for the synthetic data
    n_layer: Optional[int] = None  # shape flags: None takes model.py's default
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    batch_size: int = 8  # sequences per device per micro-step (a memory knob)
    grad_accum_steps: int = 1  # used only when batch_tokens == 0, else derived from it
    max_steps: int = 1_000_000  # an upper limit, never a schedule knob
    time_limit_min: float = 10.0  # the budget, from the first forward pass
    # --- ours ---
    model: str = "auto"  # auto: the ladder shape that fits budget x world x measured speed; or a ladder name
    shape_flags: str = "win"  # win: --n_layer/--n_head/--n_embd override --model | ignore: --model decides
    tokens_per_param: float = -1.0  # auto: the largest shape seeing this many tokens/block param; -1: per device
    auto_efficiency: float = -1.0  # fraction of the measured matmul rate a step reaches; -1: per device kind
    batch_tokens: int = -1  # global tokens per optimizer step; -1: 524288 on CUDA, literal flags on CPU; 0: literal
    metrics_path: Optional[str] = None  # default: metrics.jsonl beside the checkpoint
    val_file: Optional[str] = None  # default: the tail of the last data file
    val_tokens: int = 1_048_576  # the held-out range: the same tokens on every run
    val_eval_tokens: int = -1  # how many of them to score; -1: all on CUDA, 65536 on CPU
    val_every_min: float = 0.0  # periodic validation spends budget; the final one always runs
    save_every_min: float = 2.5  # background checkpoints, so a crash still leaves a recent one
    schedule: str = "wsd"  # wsd (warmup-stable-decay) | cosine (the starter's, for baselines)
    progress_by: str = "clock"  # clock: max(elapsed/budget, step/max_steps) | steps: step/max_steps (starter)
    warmup_frac: float = 0.0  # Muon needs no warmup; AdamW groups tolerate none at these LRs
    decay_frac: float = 0.4  # WSD: linear decay over the last 40% of the budget
    min_lr_frac: float = 0.0  # the floor the decay ends at
    optimizer: str = "muon"  # muon: Muon for hidden matrices + AdamW | adamw: AdamW for everything
    muon_lr: float = 0.05
    adamw_lr: float = 3e-3  # hidden matrices' LR when --optimizer adamw
    embed_lr: float = 0.6
    head_lr: float = 0.008
    scalar_lr: float = 0.04
    weight_decay: float = 0.0
    muon_momentum_start: float = 0.85  # warmed up: early gradients are noisy
    muon_momentum: float = 0.95
    momentum_warmup_frac: float = 0.15
    doc_aligned: bool = False  # windows start at BOS tokens when the data marks documents
    device: str = "auto"  # auto | cpu | cuda
    compile: Optional[bool] = None  # None: on for CUDA, off for CPU
    autocast: Optional[str] = None  # bf16 | none; None: bf16 on CUDA, none on CPU
    peak_tflops: float = 0.0  # per device, for MFU; 0: look it up from the GPU name
    seed: int = 0
    log_every_s: float = 1.0  # host-sync cadence: clock check, loss read, stop decision


def parse_args(argv=None):
    """Flags generated from Hyperparameters, plus one per model.py switch (default: model.py's own)."""
    # no prefix matching: an unknown --warmup must be ignored, not read as --warmup_frac
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    ours = {f.name for f in dataclasses.fields(Hyperparameters)}
    switches = [f for f in dataclasses.fields(GPTConfig) if f.name not in ours]
    for f in [*dataclasses.fields(Hyperparameters), *switches]:
        default = f.default if f.name in ours else None
        if f.type in (bool, Optional[bool]):
            parser.add_argument(f"--{f.name}", default=default, action=argparse.BooleanOptionalAction)
        else:
            kind = {Optional[int]: int, Optional[str]: str, Optional[float]: float}.get(f.type, f.type)
            parser.add_argument(f"--{f.name}", type=kind, default=default)
    args, unknown = parser.parse_known_args(argv)
    args = vars(args)
    model_switches = {f.name: value for f in switches if (value := args.pop(f.name)) is not None}
    return Hyperparameters(**args), model_switches, unknown


# ----------------------------------------------------------------------------- schedule

def schedule(progress, hp):
    """(lr_frac, muon momentum) at progress in [0, 1]: warmup, stable, linear decay to the floor."""
    p = min(max(progress, 0.0), 1.0)
    if hp.warmup_frac > 0 and p < hp.warmup_frac:
        lr_frac = p / hp.warmup_frac
    elif hp.schedule == "cosine":
        lr_frac = hp.min_lr_frac + (1.0 - hp.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * (p - hp.warmup_frac) / (1 - hp.warmup_frac)))
    elif p < 1.0 - hp.decay_frac:
        lr_frac = 1.0
    else:
        lr_frac = hp.min_lr_frac + (1.0 - hp.min_lr_frac) * (1.0 - p) / hp.decay_frac
    warm = min(p / hp.momentum_warmup_frac, 1.0) if hp.momentum_warmup_frac > 0 else 1.0
    momentum = hp.muon_momentum_start + warm * (hp.muon_momentum - hp.muon_momentum_start)
    return min(lr_frac, 1.0), momentum


# ----------------------------------------------------------------------------- setup helpers

def setup_distributed(hp):
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if hp.device == "auto":
        hp.device = "cuda" if torch.cuda.is_available() else "cpu"
    if hp.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return rank, world, device


@torch.no_grad()
def evaluate(model, batches, device, amp):
    """Mean next-token loss over this rank's fixed validation windows, averaged over ranks."""
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for x, y in batches:
        with amp:
            _, loss = model(x.to(device), y.to(device))
        total += loss.float() * y.numel()  # token-weighted: the last batch may be smaller
        count += y.numel()
    model.train()
    stats = torch.stack([total, torch.tensor(float(count), device=device)])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


# ----------------------------------------------------------------------------- main

def main(argv=None):
    hp, model_switches, unknown = parse_args(argv)
    rank, world, device = setup_distributed(hp)
    master = rank == 0
    say = (lambda msg: print(msg, flush=True)) if master else (lambda msg: None)
    if unknown:
        say(f"ignoring unknown flags: {' '.join(unknown)}")
    try:  # user errors: one clear sentence, before the clock
        data = check_inputs(hp, device, say)
        error = None
    except (ValueError, FileNotFoundError) as e:
        data, error = None, f"error: {e}"
    if world > 1:  # one rank's bad input (say, a node's staged data) stops every rank now, not at a hang
        ok = torch.tensor([float(error is None)], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if error is None and ok.item() == 0:
            error = f"error: another rank's input checks failed (rank {rank} passed); see that rank's message"
    if error is None:
        try:  # model/optimizer errors are the same on every rank, so each can exit on its own
            run = setup(hp, model_switches, data, rank, world, device, say)
        except (ValueError, FileNotFoundError) as e:
            error = f"error: {e}"
    if error is not None:
        print(error, file=sys.stderr, flush=True)
        sys.exit(2)
    train(hp, rank, world, device, say, **run)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        if device.type == "cpu":  # torch 2.13's gloo can abort in interpreter teardown (~10% of clean runs)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def check_inputs(hp, device, say):
    """Data, paths and flag values: everything a user can get wrong, checked locally (no collectives)."""
    if hp.data_dir is None and os.path.isdir("/home/data"):
        hp.data_dir = "/home/data"
    if hp.vocab_size is None:  # the synthetic chain uses ~1K ids; a 32K head would dominate a CPU run
        hp.vocab_size = 32000 if hp.data_dir else SYNTH_STATES
    data = load_token_data(hp.data_dir, hp.vocab_size, hp.seq_len, hp.val_tokens, hp.val_file)
    say(f"data: {data.source}")
    check_writable(hp.checkpoint_path, "checkpoint_path")
    if hp.metrics_path is None:
        hp.metrics_path = os.path.join(os.path.dirname(os.path.abspath(hp.checkpoint_path)), "metrics.jsonl")
    check_writable(hp.metrics_path, "metrics_path")
    if hp.val_eval_tokens < 0:
        hp.val_eval_tokens = hp.val_tokens if device.type == "cuda" else 65536
    if hp.compile is None:
        hp.compile = device.type == "cuda"
    if hp.autocast is None:
        hp.autocast = "bf16" if device.type == "cuda" else "none"
    if hp.autocast not in ("bf16", "none"):
        raise ValueError(f"--autocast must be bf16 or none, got {hp.autocast!r}")
    choices = {"shape_flags": ("win", "ignore"), "schedule": ("wsd", "cosine"), "optimizer": ("muon", "adamw"), "progress_by": ("clock", "steps")}
    for flag, allowed in choices.items():
        value = getattr(hp, flag)
        if value not in allowed:
            raise ValueError(f"--{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if hp.time_limit_min <= 0 or hp.max_steps <= 0:
        raise ValueError("--time_limit_min and --max_steps must be positive")
    if not 0.0 < hp.decay_frac <= 1.0:
        raise ValueError(f"--decay_frac must be in (0, 1] so the last step runs at the floor LR, got {hp.decay_frac}")
    return data


def setup(hp, model_switches, data, rank, world, device, say):
    """Model, optimizers, loader and the step-0 checkpoint, still before the clock."""
    if hp.batch_tokens < 0:
        hp.batch_tokens = 524288 if device.type == "cuda" else 0
    if hp.batch_tokens > 0:  # the recipe is global: world size only changes the accumulation
        hp.grad_accum_steps = max(1, round(hp.batch_tokens / (world * hp.batch_size * hp.seq_len)))

    torch.manual_seed(hp.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    shape = {k: getattr(hp, k) for k in ("n_layer", "n_head", "n_embd") if getattr(hp, k) is not None}
    if shape and hp.shape_flags == "ignore":
        say(f"ignoring shape flags {shape} (--shape_flags ignore): --model {hp.model} decides")
        shape = {}
    if not shape:  # explicit shape flags win over --model unless --shape_flags ignore
        if hp.model == "auto":
            hp.model, hp.auto_efficiency, hp.tokens_per_param = choose_shape(
                device, world, budget_s=hp.time_limit_min * 60, vocab_size=hp.vocab_size, seq_len=hp.seq_len,
                batch_size=hp.batch_size, bf16=hp.autocast == "bf16", efficiency=hp.auto_efficiency,
                tokens_per_param=hp.tokens_per_param, say=say)
        shape = shape_config(hp.model)
        hp.n_layer, hp.n_head, hp.n_embd = shape["n_layer"], shape["n_head"], shape["n_embd"]
    raw_model = get_model({"vocab_size": hp.vocab_size, "seq_len": hp.seq_len, **shape, **model_switches}).to(device)
    optimizers = build_optimizers(raw_model, use_muon=hp.optimizer == "muon", hidden_adamw_lr=hp.adamw_lr,
                                  muon_lr=hp.muon_lr, embed_lr=hp.embed_lr, head_lr=hp.head_lr,
                                  scalar_lr=hp.scalar_lr, muon_momentum=hp.muon_momentum_start,
                                  weight_decay=hp.weight_decay,
                                  tied_head=raw_model.wte.weight if raw_model.config.tie_embeddings else None)
    model = torch.compile(raw_model) if hp.compile else raw_model
    if world > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    config = {**dataclasses.asdict(hp), **dataclasses.asdict(raw_model.config)}
    if rank == 0:  # a valid checkpoint exists from the start, and the path is proven writable
        save_checkpoint({"model": cpu_state_dict(raw_model), "config": config, "step": 0, "tokens": 0}, hp.checkpoint_path)
    loader = BatchLoader(data.train, hp.seq_len, hp.batch_size, rank, world, seed=hp.seed, device=device,
                         doc_aligned=hp.doc_aligned, bos_id=data.bos_id)
    val = val_batches(data.val, hp.seq_len, hp.batch_size, rank, world, max_tokens=hp.val_eval_tokens)
    return dict(raw_model=raw_model, model=model, optimizers=optimizers, loader=loader, val=val, config=config)


def train(hp, rank, world, device, say, raw_model, model, optimizers, loader, val, config):
    master = rank == 0
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if hp.autocast == "bf16" else nullcontext()
    step_tokens = world * hp.batch_size * hp.seq_len * hp.grad_accum_steps
    flops_per_token = raw_model.flops_per_token(hp.seq_len)
    peak = (hp.peak_tflops * 1e12 if hp.peak_tflops > 0 else peak_flops(device)) * world
    say(f"model: {raw_model.num_params() / 1e6:.1f}M params ({raw_model.num_params(True) / 1e6:.1f}M non-embedding), "
        f"{flops_per_token / 1e9:.3f} GFLOPs/token | {world} x {device.type} | {step_tokens} tokens/step = "
        f"{world} x {hp.batch_size} x {hp.seq_len} x {hp.grad_accum_steps} accum | compile {hp.compile} | "
        f"autocast {hp.autocast} | budget {hp.time_limit_min} min, max_steps {hp.max_steps}")
    checkpointer = Checkpointer(hp.checkpoint_path)
    meta = lambda step: {"config": config, "step": step, "tokens": step * step_tokens}
    metrics = open(hp.metrics_path, "w") if master else None

    def emit(row):
        if master:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    stop_signal = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_signal.append(signum))  # finish the step, save
    signal.signal(signal.SIGINT, lambda signum, frame: stop_signal.append(signum))

    budget = hp.time_limit_min * 60.0
    bar = tqdm(total=round(budget), unit="s", disable=not master, dynamic_ncols=True, mininterval=1.0)
    gc.collect()
    gc.disable()  # a collection pause on one rank stalls all of them
    loss_sum = torch.zeros((), device=device)
    step, steps_since_sync, lr_frac, progress = 0, 0, 0.0, 0.0
    last_step, next_sync = hp.max_steps - 1, 0  # last_step is replanned from the measured step time
    step_time, compile_s = None, 0.0
    sync_step, sync_elapsed, last_save, last_val = 0, 0.0, 0.0, 0.0
    stop_reason = "max_steps"
    t0 = time.perf_counter()  # the clock starts right before the first forward pass
    while True:
        if step >= next_sync or step > last_step:
            # one collective per sync: the slowest rank's clock, any stop signal, the mean loss
            stats = torch.tensor([time.perf_counter() - t0, float(bool(stop_signal))], device=device)
            mean_loss = loss_sum / max(steps_since_sync, 1)
            if world > 1:
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                dist.all_reduce(mean_loss)
                mean_loss /= world
            elapsed, signalled = stats.tolist()
            train_loss = mean_loss.item()
            if step == 1:
                compile_s = elapsed  # the first step carries compilation and warm-up
            elif step > 1:
                interval = (elapsed - sync_elapsed) / (step - sync_step)
                step_time = interval if step_time is None else 0.5 * step_time + 0.5 * interval
            if steps_since_sync:
                if not math.isfinite(train_loss):
                    say(f"stopping: non-finite training loss at step {step}; "
                        f"{hp.checkpoint_path} keeps the last good weights")
                    emit({"step": step, "elapsed_s": round(elapsed, 3), "error": "non-finite loss"})
                    checkpointer.wait()
                    sys.exit(1)
                tok_s = steps_since_sync * step_tokens / max(elapsed - sync_elapsed, 1e-9)
                row = {"step": step, "elapsed_s": round(elapsed, 3), "lr_frac": lr_frac, "train_loss": train_loss,
                       "tokens": step * step_tokens, "tokens_per_s": round(tok_s)}
                if peak:
                    row["mfu"] = round(tok_s * flops_per_token / peak, 4)
                emit(row)
                bar.set_postfix(step=step, loss=f"{train_loss:.3f}", lr=f"{lr_frac:.2f}", tok_s=f"{tok_s:.3g}",
                                **({"mfu": f"{row['mfu']:.1%}"} if peak else {}), refresh=False)
                bar.update(min(round(elapsed), bar.total) - bar.n)
            if signalled:
                stop_reason = "signal"
                break
            if step >= hp.max_steps:
                break
            # plan the rest: only steps that finish inside the budget are started
            per_step = step_time if step_time is not None else elapsed / max(step, 1)
            if step > 0 and elapsed + per_step > budget:
                stop_reason = "time_limit"
                break
            if step_time is not None:  # plan pessimistically, with a step of slack: a slow step must not
                # skip the final decay; steps that still fit after the planned last one run at the floor
                slow = max(step_time, interval)
                last_step = min(hp.max_steps - 1, step + int((budget - elapsed) / slow - 1.0) - 1)
                next_sync = step + max(1, min(int(hp.log_every_s / step_time), (last_step - step) // 2))
            else:
                next_sync = step + 1  # steps 0 and 1 measure compile time, then the steady step time
            loss_sum.zero_()
            steps_since_sync, sync_step, sync_elapsed = 0, step, elapsed
            if master and hp.save_every_min > 0 and elapsed - last_save >= hp.save_every_min * 60:
                checkpointer.save(raw_model, meta(step), background=True)
                last_save = elapsed
            if hp.val_every_min > 0 and elapsed - last_val >= hp.val_every_min * 60:
                emit({"step": step, "elapsed_s": round(elapsed, 3), "val_loss": evaluate(raw_model, val, device, amp)})
                last_val = elapsed
        # progress at the end of this step: the clock's forecast or the step limit, whichever is ahead;
        # it never goes back, so steps that still fit after the planned last one stay at the floor
        forecast = sync_elapsed + (step - sync_step + 1) * (step_time or 0.0)
        if hp.progress_by == "steps":  # the starter's way: blind to the clock, kept to measure what it costs
            progress = (step + 1) / hp.max_steps
        else:
            progress = 1.0 if step >= last_step else max(progress, forecast / budget, (step + 1) / hp.max_steps)
        lr_frac, momentum = schedule(progress, hp)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * lr_frac
                if "momentum" in group:
                    group["momentum"] = momentum
        for micro in range(hp.grad_accum_steps):
            x, y = next(loader)
            # gradients are all-reduced once per optimizer step, on the last micro-step
            sync_grads = world == 1 or micro == hp.grad_accum_steps - 1
            with nullcontext() if sync_grads else model.no_sync():
                with amp:
                    _, loss = model(x, y)
                (loss / hp.grad_accum_steps).backward()
            loss_sum += loss.detach() / hp.grad_accum_steps
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        step += 1
        steps_since_sync += 1
    gc.enable()
    bar.close()
    loader.close()

    # after the clock: save first, then validate (a slow eval can never cost the checkpoint)
    train_s = time.perf_counter() - t0
    if master:
        checkpointer.save(raw_model, meta(step), background=False)
    say(f"saved {hp.checkpoint_path} at step {step} ({stop_reason}) after {train_s:.1f}s")
    val_loss = evaluate(raw_model, val, device, amp)
    emit({"step": step, "elapsed_s": round(train_s, 3), "val_loss": val_loss})
    summary = {"summary": True, "steps": step, "tokens": step * step_tokens, "train_s": round(train_s, 3),
               "tokens_per_s": round(step * step_tokens / max(train_s, 1e-9)), "compile_s": round(compile_s, 3),
               "final_lr_frac": lr_frac, "stop_reason": stop_reason, "val_loss": val_loss,
               "params": raw_model.num_params(), "world_size": world,
               "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}
    emit(summary)
    say(json.dumps(summary))
    if master:
        metrics.close()


if __name__ == "__main__":
    main()

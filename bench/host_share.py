"""The host's share of an event step: aten ops dispatched and host milliseconds per optimizer step at the event's
structure (16 blocks, 96 Muon matrices, the default tables and switches, the plan's accumulation), at a width,
sequence and vocabulary where compute is ~0, so what is left is what the host does.

    python bench/host_share.py                        # op counts (eager), host ms (compiled, as the event runs)
    python bench/host_share.py --vs /tmp/before       # side by side with another checkout, alternating A B A B
    python bench/host_share.py --counts_only --json   # the counts alone, one JSON object (tests read it)

Counted under a TorchDispatchMode: every aten op the host dispatches, split into ops that launch work and
metadata-only ones (views, detach, empty allocations: no kernel on CUDA). Categories: the optimizer step, the eager
glue of a micro-step outside the blocks (forward and backward), the head loss's eager part (its chunk math is one
compiled call at the event), zero_grad. Compiled-region calls are counted by wrapping them. Host ms: the same
structure compiled per block with the compiled head loss, as launch.py builds it, timed per step on one thread in
that thread's CPU seconds (time.thread_time), so a shared machine's waits for a core do not count.
"""

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
# no kernel launches on CUDA: aliases, views and allocations without a fill
METADATA_OPS = {
    "aten.detach.default",
    "aten.lift_fresh.default",
    "aten.alias.default",
    "aten.empty.memory_format",
    "aten.empty_like.default",
    "aten.empty_strided.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten._reshape_alias.default",
    "aten._unsafe_view.default",
    "aten.set_.source_Tensor",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
}


def launches(func):
    return not func.is_view and str(func) not in METADATA_OPS


class OpCount(TorchDispatchMode):
    """Dispatched aten ops by category (`where`, set by the caller), launching and metadata-only apart."""

    def __init__(self):
        super().__init__()
        self.where = None
        self.ops = collections.defaultdict(collections.Counter)
        self.meta = collections.Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.where is not None:
            if launches(func):
                self.tally(self.where, str(func))
            else:
                self.meta[self.where] += 1
            self.syncs += str(func) == "aten._local_scalar_dense.default"
        return func(*args, **(kwargs or {}))

    def tally(self, where, name):
        if where is not None:
            self.ops[where][name] += 1

    @contextlib.contextmanager
    def counting(self, where):
        previous, self.where = self.where, where
        try:
            yield
        finally:
            self.where = previous


def event_structure(args):
    """The model (the event's 16 blocks and default switches at a compute-free width), its optimizers as train.py
    builds them from config.py's defaults, and a batch maker."""
    from config import Hyperparameters
    from model import get_model
    from optimizers import optimizers_for_run

    hp = Hyperparameters()
    torch.manual_seed(0)
    model = get_model(
        {"vocab_size": args.vocab, "n_layer": 16, "n_head": 2, "n_embd": args.width, "seq_len": args.seq_len}
    )
    optimizers = optimizers_for_run(model, hp)
    generator = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return model, optimizers, batch


def block_hooks(model, counter):
    """Hooks that stop counting inside every compiled part (the blocks, MUDD's mixes), forward and backward: what is
    left is the glue between them."""
    off = (lambda *_: setattr(counter, "where", None), lambda *_: setattr(counter, "where", counter.outer))
    handles = []
    for block in model.compiled_parts():
        handles.append(block.register_forward_pre_hook(off[0]))
        handles.append(block.register_forward_hook(off[1]))
        handles.append(block.register_full_backward_pre_hook(off[0]))
        handles.append(block.register_full_backward_hook(off[1]))
    return handles


class FusedOnCuda(torch.autograd.Function):
    """F.rms_norm counted as the one kernel each way CUDA runs (aten._fused_rms_norm and its backward), where the CPU
    build decomposes it into five forward ops and about nine backward ones."""

    @staticmethod
    def forward(ctx, x, counter):
        ctx.counter, ctx.where = counter, counter.where
        ctx.save_for_backward(x)
        with counter.counting(None):
            out = torch.nn.functional.rms_norm(x, (x.size(-1),))
        counter.tally(counter.where, "rms_norm (fused on CUDA)")
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with ctx.counter.counting(None), torch.enable_grad():
            x = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(torch.nn.functional.rms_norm(x, (x.size(-1),)), x, grad)
        ctx.counter.tally(ctx.counter.where, "rms_norm backward (fused on CUDA)")
        return dx, None


def count_ops(args, cuda_norms=False):
    """Launching ops per category at steady state (step 1 on: step 0 creates the optimizer state), per optimizer
    step of args.accum micro-steps. The head loss's chunk math is one compiled call at the event: not counted.
    cuda_norms: the glue's RMS norms counted as CUDA's one fused kernel each way."""
    import model as model_module
    from headloss import chunk_loss, head_loss

    model, optimizers, batch = event_structure(args)
    counter = OpCount()

    def compiled_at_the_event(*a, **k):
        with counter.counting(None):
            return chunk_loss(*a, **k)

    def loss_fn(*a, **k):
        with counter.counting("head loss"):
            return head_loss(*a, **k, chunk_fn=compiled_at_the_event)

    if cuda_norms:
        model_module.rms_norm = lambda x: FusedOnCuda.apply(x, counter)

    results = {}
    for step in range(2):
        counter.ops.clear()
        counter.meta.clear()
        handles = []
        with counter:
            for micro in range(args.accum):
                x, y = batch()
                counter.outer = "glue forward"
                with counter.counting("glue forward"):
                    handles = block_hooks(model, counter) if micro == 0 else handles
                    _, loss = model(x, y, loss_fn=loss_fn)
                counter.outer = "glue backward"
                with counter.counting("glue backward"):
                    (loss / args.accum).backward()
            for h in handles:
                h.remove()
            with counter.counting("optimizer"):
                for opt in optimizers:
                    opt.step()
            with counter.counting("zero_grad"):
                model.zero_grad(set_to_none=True)
        results[step] = {k: sum(v.values()) for k, v in counter.ops.items()}
    if cuda_norms:
        model_module.rms_norm = lambda x: torch.nn.functional.rms_norm(x, (x.size(-1),))
    steady = counter.ops
    per_micro = {k: results[1].get(k, 0) / args.accum for k in ("glue forward", "glue backward", "head loss")}
    return {
        "optimizer_ops": results[1].get("optimizer", 0),
        "optimizer_ops_step0": results[0].get("optimizer", 0),
        "zero_grad_ops": results[1].get("zero_grad", 0),
        "glue_forward_ops_per_micro": per_micro["glue forward"],
        "glue_backward_ops_per_micro": per_micro["glue backward"],
        "head_loss_eager_ops_per_micro": per_micro["head loss"],
        "metadata_ops_per_step": sum(counter.meta.values()),
        "host_syncs_per_step": counter.syncs,
        "muon_matrices": sum(len(g["params"]) for g in optimizers[0].param_groups),
        "top_optimizer_ops": steady["optimizer"].most_common(8),
        "top_glue_forward_ops": steady["glue forward"].most_common(8),
    }


def time_compiled(args):
    """Host ms per optimizer step, compiled as launch.py builds it (per block, the head loss's chunk math), on one
    thread; and the compiled-region calls a micro-step makes."""
    import torch._inductor.config as inductor_config
    from headloss import compiled_head_loss
    from ranks import lower_backward_in_forward

    torch.set_num_threads(1)
    inductor_config.cpp.enable_kernel_profile = True  # each fused C++ kernel a profiler event, as Triton's are
    model, optimizers, batch = event_structure(args)
    lower_backward_in_forward()
    model.compile_per_block()
    calls = collections.Counter()

    def counted(kind, fn):
        def call(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)

        return call

    for part in model.compiled_parts():
        part._compiled_call_impl = counted("block", part._compiled_call_impl)
    loss_fn = compiled_head_loss(lambda fn: counted("head chunk", fn))
    step_s, opt_s = [], []
    for step in range(args.warmup + args.steps):
        calls.clear()
        start = time.thread_time()  # this thread's CPU seconds: on a shared machine, the waits for a core drop out
        opt_start = one_step(model, optimizers, batch, loss_fn, args.accum)
        end = time.thread_time()
        if step >= args.warmup:
            step_s.append(end - start)
            opt_s.append(end - opt_start)
    per_micro = {k: v / args.accum for k, v in calls.items()}
    inside = profiled_step(lambda: one_step(model, optimizers, batch, loss_fn, args.accum))
    return {
        **{f"{k}_per_step": v for k, v in inside.items()},
        "step_ms": 1e3 * statistics.median(step_s),
        "optimizer_ms": 1e3 * statistics.median(opt_s),
        "micro_step_ms": 1e3 * (statistics.median(step_s) - statistics.median(opt_s)) / args.accum,
        # one compiled backward per compiled forward that takes gradients (the blocks and mixes; the chunk math no_grad)
        "compiled_calls_per_micro": 2 * per_micro.get("block", 0) + per_micro.get("head chunk", 0),
    }


def one_step(model, optimizers, batch, loss_fn, accum):
    """An optimizer step as train.py's loop takes it; returns when its optimizer part began (thread_time)."""
    for _ in range(accum):
        x, y = batch()
        _, loss = model(x, y, loss_fn=loss_fn)
        (loss / accum).backward()
    opt_start = time.thread_time()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return opt_start


def profiled_step(step):
    """What one compiled step runs, from a torch.profiler capture: the kernels inside the compiled regions (on CPU
    inductor's fused C++ kernels and the extern GEMM/attention calls; on CUDA Triton kernels in their place, a
    similar count) and autograd's per-parameter gradient accumulations (one add a parameter a micro-step after the
    first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    kernels = accumulations = 0
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and parent.name.startswith("## Call CompiledFxGraph"):
            kernels += 1
        accumulations += event.name == "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
    return {"compiled_kernels": kernels, "grad_accumulations": accumulations}


def unit_costs(reps=3000):
    """This machine's host cost, in thread-CPU us, of one eager op on a tiny tensor and of one call into a small
    compiled region with autograd (guards, runtime wrapper, one fused kernel each way): the factors that turn the
    counts into milliseconds."""
    torch.set_num_threads(1)
    t = torch.ones(8)
    for _ in range(100):
        torch.mul(t, t)
    start = time.thread_time()
    for _ in range(reps):
        torch.mul(t, t)
    eager_us = 1e6 * (time.thread_time() - start) / reps
    region = torch.compile(lambda x: (x * 2 + 1).relu(), fullgraph=True, dynamic=False)
    x = torch.ones(8, requires_grad=True)
    for _ in range(20):
        region(x).sum().backward()
    start = time.thread_time()
    for _ in range(reps // 10):
        region(x).sum().backward()
    per_call = 1e6 * (time.thread_time() - start) / (reps // 10)
    return {"eager_op_us": eager_us, "compiled_call_fwd_bwd_us": per_call - 3 * eager_us}  # less sum, its backward


def event_host_ms(counts, units, accum, chunks, launch_us):
    """Host ms of one optimizer step at the event's plan (accum micro-steps, chunks head-loss chunks a micro-step)
    from the counts: every launching op, compiled kernel and gradient accumulation at this machine's dispatch cost
    plus launch_us for the CUDA launch itself (cudaLaunchKernel's host side), each compiled forward + backward pair
    at the measured call's overhead. The head loss's eager ops grow ~5 a chunk past the counted structure's one."""
    launch = units["eager_op_us"] + launch_us
    per_micro = counts["glue_forward_cuda_launches_per_micro"] + counts["glue_backward_cuda_launches_per_micro"]
    per_micro += counts["head_loss_eager_ops_per_micro"] + 5 * (chunks - 1)
    per_micro += counts["compiled_kernels_per_step"] / counts["accum"] + chunks  # the chunk math: one kernel each
    per_micro += counts["grad_accumulations_per_step"] / max(counts["accum"] - 1, 1) * (accum - 1) / accum
    regions = counts["compiled_calls_per_micro"] / 2  # forward and backward, one pair a block
    micro_us = per_micro * launch + regions * units["compiled_call_fwd_bwd_us"]
    return 1e-3 * (counts["optimizer_ops"] * launch + accum * micro_us)


def measure(args):
    result = count_ops(args)
    result["accum"] = args.accum
    cuda = count_ops(args, cuda_norms=True)
    for key in ("glue_forward_ops_per_micro", "glue_backward_ops_per_micro"):
        result[key.replace("_ops", "_cuda_launches")] = cuda[key]
    if not args.counts_only:
        result.update(time_compiled(args))
        units = unit_costs()
        result.update(units)
        for launch_us in (2, 6):
            result[f"event_host_ms_launch_{launch_us}us"] = event_host_ms(
                result, units, args.event_accum, args.event_chunks, launch_us
            )
    return result


def side_by_side(args):
    """This checkout and args.vs, alternating, each in its own process; the medians of args.rounds each."""
    flags = [f"--{k}={getattr(args, k)}" for k in ("accum", "micro_batch", "seq_len", "width", "vocab")]
    flags += [f"--steps={args.steps}", f"--warmup={args.warmup}", "--json"]
    flags += [f"--event_accum={args.event_accum}", f"--event_chunks={args.event_chunks}"]
    runs = {"this": [], "vs": []}
    for _ in range(args.rounds):
        for name, repo in (("vs", args.vs), ("this", str(ROOT))):
            command = [sys.executable, __file__, "--repo", repo, *flags]
            out = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'':34} {'vs (' + args.vs + ')':>24} {'this':>12}")
    for key in runs["this"][0]:
        if key.startswith("top_"):
            continue
        a = statistics.median(r[key] for r in runs["vs"])
        b = statistics.median(r[key] for r in runs["this"])
        print(f"{key:34} {a:24.4g} {b:12.4g}")
    for key in ("top_optimizer_ops", "top_glue_forward_ops"):
        print(f"{key}: vs {runs['vs'][0][key]}\n{'':>{len(key) + 2}}this {runs['this'][0][key]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accum", type=int, default=6, help="micro-steps per optimizer step (the event plan's)")
    parser.add_argument("--micro_batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="with --vs: runs of each checkout")
    parser.add_argument("--event_accum", type=int, default=4, help="the event plan's micro-steps, for event_host_ms")
    parser.add_argument("--event_chunks", type=int, default=8, help="the event plan's head-loss chunks a micro-step")
    parser.add_argument("--counts_only", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repo", default=str(ROOT), help="the checkout whose modules are measured")
    parser.add_argument("--vs", help="another checkout, measured side by side")
    args = parser.parse_args()
    if args.vs:
        side_by_side(args)
        return
    sys.path.insert(0, args.repo)
    os.chdir(args.repo)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:34} {value}")


if __name__ == "__main__":
    main()

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
structure compiled per block with the compiled head loss, as launch.py builds it, timed per step on one thread.
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
    from muon import build_optimizers

    hp = Hyperparameters()
    torch.manual_seed(0)
    model = get_model(
        {"vocab_size": args.vocab, "n_layer": 16, "n_head": 2, "n_embd": args.width, "seq_len": args.seq_len}
    )
    optimizers = build_optimizers(
        model,
        muon_lr=hp.muon_lr,
        embed_lr=hp.embed_lr,
        head_lr=hp.head_lr,
        scalar_lr=hp.scalar_lr,
        muon_momentum=hp.muon_momentum_start,
        muon_weight_decay=hp.muon_weight_decay,
        adam_weight_decay=hp.adam_weight_decay,
        ns_coeffs=hp.ns_coeffs,
        normuon_beta2=hp.normuon_beta2,
    )
    generator = torch.Generator().manual_seed(1)

    def batch():
        idx = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return model, optimizers, batch


def block_hooks(model, counter):
    """Hooks that stop counting inside every block, forward and backward: what is left is the glue between them."""
    off = (lambda *_: setattr(counter, "where", None), lambda *_: setattr(counter, "where", counter.outer))
    handles = []
    for block in model.blocks:
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
    from headloss import compiled_head_loss
    from ranks import lower_backward_in_forward

    torch.set_num_threads(1)
    model, optimizers, batch = event_structure(args)
    lower_backward_in_forward()
    model.compile_per_block()
    calls = collections.Counter()

    def counted(kind, fn):
        def call(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)

        return call

    for block in model.blocks:
        block._compiled_call_impl = counted("block", block._compiled_call_impl)
    loss_fn = compiled_head_loss(lambda fn: counted("head chunk", fn))
    step_s, opt_s = [], []
    for step in range(args.warmup + args.steps):
        calls.clear()
        start = time.perf_counter()
        for micro in range(args.accum):
            x, y = batch()
            _, loss = model(x, y, loss_fn=loss_fn)
            (loss / args.accum).backward()
        opt_start = time.perf_counter()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        end = time.perf_counter()
        if step >= args.warmup:
            step_s.append(end - start)
            opt_s.append(end - opt_start)
    per_micro = {k: v / args.accum for k, v in calls.items()}
    return {
        "step_ms": 1e3 * statistics.median(step_s),
        "optimizer_ms": 1e3 * statistics.median(opt_s),
        "micro_step_ms": 1e3 * (statistics.median(step_s) - statistics.median(opt_s)) / args.accum,
        # one compiled backward per compiled forward that takes gradients (the blocks; the chunk math runs no_grad)
        "compiled_calls_per_micro": 2 * per_micro.get("block", 0) + per_micro.get("head chunk", 0),
    }


def measure(args):
    result = count_ops(args)
    cuda = count_ops(args, cuda_norms=True)
    for key in ("glue_forward_ops_per_micro", "glue_backward_ops_per_micro"):
        result[key.replace("_ops", "_cuda_launches")] = cuda[key]
    if not args.counts_only:
        result.update(time_compiled(args))
    return result


def side_by_side(args):
    """This checkout and args.vs, alternating, each in its own process; the medians of args.rounds each."""
    flags = [f"--{k}={getattr(args, k)}" for k in ("accum", "micro_batch", "seq_len", "width", "vocab")]
    flags += [f"--steps={args.steps}", f"--warmup={args.warmup}", "--json"]
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

"""Head + loss: full float32 logits (forward(idx, targets)) against the chunked head_loss (loss_fn=head_loss), and
the chunk loss math's two forms (headloss.chunk_loss in place, headloss.functional_chunk_loss for the compiler).

    python bench/head_loss.py [--rounds 7] [--threads 1]       # every part below, on CPU (the forms: on --device)
    python bench/head_loss.py --parts forms [--device cuda]    # 3 and 4 only: what bench/gpu_check.sh runs
    python bench/head_loss.py --parts codegen [--code_dir DIR] # 5 only (CPU, no GPU needed)

1. ms per training step at the bench shape (4 layers, width 128, 4 heads, seq 256, 8 sequences, vocab 32,000):
   forward + backward of the whole model and the optimizer step, as train.py runs them (Muon + AdamW for the
   default, AdamW alone for the starter-like model, freed memory kept by ranks.keep_freed_memory), for each model
   through both paths. One process; one path at a time, as a real run takes one, the two models alternating round
   by round after WARMUP_ROUNDS. Best and median of --rounds, and the median of each round's own default / starter
   ratio (neighbours in time share the box's load). Each chunked step is also split by wall clock into phases:
   the body's forward (to the final norm), the head's matmuls, its per-chunk loss math (headloss.chunk_loss, wrapped),
   backward and the optimizers; their medians show where the default's extra time goes. (The profiler misplaces it:
   it charged the cap's scalar multiply 25 ms a chunk, which timers put at 8.7.)
2. Peak memory of one forward + backward at 8 x 1024 tokens, vocab 32,000: the CPU allocator's live bytes, read
   from the profiler's memory events (profile_memory=True), for the whole step and for head + loss alone, i.e. the
   highest live bytes after the final norm returns, minus those live at that moment.
3. ms per chunk of each form of the loss math, eager and compiled, and today's compiled CUDA path before this form
   (the in-place form compiled, the float32 upcast and the downcast of g around it, eager), capped and uncapped,
   at the chunk the device's training takes at a 32,000 vocabulary (CUDA: the event's 3,328 rows in bf16, capped
   only; CPU: 512 rows, float32 as CPU training runs and bf16): medians of --rounds, all alternating round by round.
4. Their agreement with the in-place form eagerly: the largest row-loss difference and the largest gradient
   difference over the largest gradient entry.
5. What inductor makes of each compiled form (CPU codegen, 256 rows): the (rows, V) buffers it allocates and the
   loops over the chunk, as compiled for the CPU and with the CPU-only realize heuristics off (inductor realises a
   reused sigmoid or exp on CPU only: what is left is what a CUDA device's lowering keeps); --code_dir writes the code.
"""

import argparse
import functools
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from ranks import keep_freed_memory  # noqa: E402
from model import get_model  # noqa: E402
from headloss import LOSS_CHUNK_BYTES, chunk_loss, chunk_rows, functional_chunk_loss, head_loss  # noqa: E402
from optimizers import build_optimizers  # noqa: E402

SHAPE = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 32000}
# bench/speedrun.py's `starter` variant, model flags only
STARTER = {
    "norm": "layer",
    "pos": "learned",
    "mlp_act": "gelu",
    "qk_norm": False,
    "logit_softcap": 0.0,
    "value_embeds": False,
    "x0_mix": False,
    "resid_scale": False,
    "unet_skips": False,
    "zero_init_proj": False,
    "embed_norm": False,
    "tie_embeddings": True,
}
MODELS = {"default": {}, "starter": STARTER}
PATHS = {"full logits": False, "chunked": True}  # chunked: model(x, y, loss_fn=head_loss), as train.py


def batch(B, T, seed=0):
    tokens = torch.randint(0, SHAPE["vocab_size"], (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


class PhaseClock:
    """A training step as train.py takes it, split by wall clock: the final norm's forward hook marks where the head
    starts, a wrapper of headloss.chunk_loss sums the loss math's time, and the rest of the head's forward is its
    matmuls (and a few small per-chunk ops)."""

    def __init__(self, model):
        self.model, self.chunk_s, self.head_start = model, 0.0, 0.0
        self.loss_fn = functools.partial(head_loss, chunk_fn=self.timed_chunk)
        model.norm_f.register_forward_hook(self.mark_head)

    def timed_chunk(self, *args):
        start = time.perf_counter()
        out = chunk_loss(*args)
        self.chunk_s += time.perf_counter() - start
        return out

    def mark_head(self, *_):
        self.head_start = time.perf_counter()

    def step(self, x, y, chunked, optimizers):
        """One training step; returns ms per phase (with full logits, "head matmuls" is the whole head and loss)."""
        self.chunk_s = 0.0
        start = time.perf_counter()
        loss = self.model(x, y, loss_fn=self.loss_fn if chunked else None)[1]
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        for opt in optimizers:
            opt.step()
        end = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        seconds = {
            "body forward": self.head_start - start,
            "head matmuls": forward_end - self.head_start - self.chunk_s,
            "loss math": self.chunk_s,
            "backward": backward_end - forward_end,
            "optimizers": end - backward_end,
            "step": end - start,
        }
        return {phase: 1000 * s for phase, s in seconds.items()}


def optimizers_of(name, model):
    """train.py's optimizers for the variant (the learning rates do not change the step's cost)."""
    tied = model.wte.weight if model.config.tie_embeddings else None
    lrs = dict(muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    return build_optimizers(model, **lrs, use_muon=name == "default", tied_head=tied)


# Rounds before timing, per path: the heap stops growing (and faulting fresh pages in) after the third step or
# so. Paths are not interleaved: freeing the full logits' gigabyte trims the heap, and the next step faults it back.
WARMUP_ROUNDS = 4


def step_phases(rounds, seq_len=256, batch_size=8):
    torch.manual_seed(0)
    models = {name: get_model({**SHAPE, "seq_len": seq_len, **flags}) for name, flags in MODELS.items()}
    optimizers = {name: optimizers_of(name, model) for name, model in models.items()}
    x, y = batch(batch_size, seq_len)
    clocks = {name: PhaseClock(model) for name, model in models.items()}
    runs = {(m, p): [] for m in models for p in PATHS}
    for p, chunked in PATHS.items():
        for r in range(WARMUP_ROUNDS + rounds):
            for m in models:
                phases = clocks[m].step(x, y, chunked, optimizers[m])
                if r >= WARMUP_ROUNDS:
                    runs[m, p].append(phases)
    return runs


def peak_bytes(model, x, y, loss_fn):
    """(whole step, head + loss) peak live bytes above the start of each: CPU allocator events from the profiler,
    whose running total counts what was allocated while it ran (the gradients included)."""
    model(x, y, loss_fn=loss_fn)[1].backward()  # warm-up
    model.zero_grad(set_to_none=True)

    def mark_head(*_):
        with torch.profiler.record_function("head starts"):
            pass

    hook = model.norm_f.register_forward_hook(mark_head)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x, y, loss_fn=loss_fn)[1].backward()
    hook.remove()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
        events = json.loads(pathlib.Path(tmp, "trace.json").read_text())["traceEvents"]
    head_start = min(e["ts"] for e in events if e.get("name") == "head starts")
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    at_head = max([total for ts, total in memory if ts <= head_start], default=0)
    after_head = [total for ts, total in memory if ts > head_start]
    return max(total for _, total in memory), max(after_head) - at_head


def casts_outside(compiled):
    """Today's compiled CUDA path before the functional form: the matmul's output upcast to float32 and g cast back
    by eager ops around the compiled in-place form."""

    def call(y, targets, mix, cap, need_grad):
        row_loss, total, g = compiled(y.float(), targets, mix, cap, need_grad)
        return row_loss, total, g.to(y.dtype)

    return call


def chunk_forms():
    def compiled(fn):
        return torch.compile(fn, fullgraph=True, dynamic=False)

    return {
        "in-place eager": chunk_loss,
        "functional eager": functional_chunk_loss,
        "in-place compiled, casts outside": casts_outside(compiled(chunk_loss)),
        "in-place compiled": compiled(chunk_loss),
        "functional compiled": compiled(functional_chunk_loss),
    }


def chunk_inputs(rows, vocab, dtype, device):
    """A chunk as HeadLoss hands it over: y with logits' spread (capped: past the cap), targets (rows, 1), every one
    counted (mix 1)."""
    gen = torch.Generator().manual_seed(0)
    y = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
    return y, torch.randint(0, vocab, (rows, 1), generator=gen).to(device), torch.ones(rows, 1, device=device)


def time_forms(forms, inputs, cap, rounds):
    """{form: median ms of one call} and {form: (row-loss difference, gradient difference / largest gradient)}
    against the in-place form eagerly, for inputs (y, targets, mix); every form once a round, so neighbours in time
    compare. Each call gets a fresh copy of y (the in-place form writes into it)."""
    y, targets, mix = inputs
    sync = torch.cuda.synchronize if y.is_cuda else lambda: None
    times, agreement = {}, {}
    reference = chunk_loss(y.clone(), targets, mix, cap, True)  # then warm-up and compilation
    for name, fn in forms.items():
        row_loss, _, g = fn(y.clone(), targets, mix, cap, True)
        agreement[name] = (
            (row_loss - reference[0]).abs().max().item(),
            ((g.float() - reference[2].float()).abs().max() / reference[2].float().abs().max()).item(),
        )
        times[name] = []
    for _ in range(rounds):
        for name in times:
            y_copy = y.clone()
            sync()
            start = time.perf_counter()
            forms[name](y_copy, targets, mix, cap, True)
            sync()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}, agreement


def print_forms(device, rounds):
    vocab = SHAPE["vocab_size"]
    rows = 3328 if device.type == "cuda" else chunk_rows(8 * 1024, vocab, LOSS_CHUNK_BYTES["cpu"])
    # CUDA: the event's case alone (bf16, capped), so bench/gpu_check.sh's call stays short: 6 compiles
    dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32, torch.bfloat16)
    caps = (15.0,) if device.type == "cuda" else (15.0, 0.0)
    forms = chunk_forms()
    print(f"\nms per chunk of {rows} x {vocab} on {device}, median of {rounds} rounds; agreement with in-place eager")
    print(f"{'dtype':<9} {'cap':>4} {'form':<33} {'ms':>8} {'loss diff':>10} {'g diff':>8}")
    for dtype in dtypes:
        for cap in caps:
            ms, agreement = time_forms(forms, chunk_inputs(rows, vocab, dtype, device), cap, rounds)
            for name, (loss_diff, g_diff) in agreement.items():
                row = f"{str(dtype)[6:]:<9} {cap:4.0f} {name:<33} {ms[name]:8.2f}"
                print(f"{row} {loss_diff:10.1e} {g_diff:8.1e}")
            ratio = ms["functional compiled"] / ms["in-place compiled, casts outside"]
            print(f"{'':<14} functional compiled / in-place compiled, casts outside: {ratio:.2f}x")


def compiled_code(fn, y, targets, mix, cap, cpu_heuristics):
    """The output code inductor writes for fn at these inputs; cpu_heuristics False: with ir.is_cpu answering False
    in its realize heuristics (the only places it asks), as a CUDA device's lowering decides."""
    from unittest import mock

    from torch._inductor import config, ir
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with config.patch(fx_graph_cache=False), mock.patch.object(ir, "is_cpu", lambda node: cpu_heuristics):
        return run_and_get_code(compiled, y, targets, mix, cap, True)[1][-1]


def print_codegen(code_dir):
    rows, vocab = 256, SHAPE["vocab_size"]
    forms = {  # (form, the dtype it is handed) as the CUDA path calls it, before and after
        "in-place (before: float32 in)": (chunk_loss, torch.float32),
        "functional (after: bf16 in)": (functional_chunk_loss, torch.bfloat16),
    }
    print(f"\ninductor's code for a {rows} x {vocab} chunk: (rows, V) buffers allocated and loops over the chunk")
    print(f"{'form':<30} {'cap':>4} {'heuristics':<11} {'(rows, V) buffers':<28} {'loops':>5}")
    full = re.compile(rf"empty_strided_cpu\(\({rows}, {vocab}\), \({vocab}, 1\), torch\.(\w+)\)")
    loop = re.compile(rf"for\(.*<static_cast<int64_t>\(({vocab}|{rows * vocab})L\)")
    for name, (fn, dtype) in forms.items():
        for cap in (15.0, 0.0):
            inputs = chunk_inputs(rows, vocab, dtype, torch.device("cpu"))
            for heuristics in ("cpu", "cuda's"):
                code = compiled_code(fn, *inputs, cap, heuristics == "cpu")
                buffers = ", ".join(full.findall(code)) or "none"
                print(f"{name:<30} {cap:4.0f} {heuristics:<11} {buffers:<28} {len(loop.findall(code)):5d}")
                if code_dir:
                    slug = f"{name.split()[0]}_cap{cap:.0f}_{heuristics[:3]}".replace("-", "_").replace(",", "")
                    pathlib.Path(code_dir, f"{slug}.py").write_text(code)


PARTS = ("steps", "memory", "forms", "codegen")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed steps of each model and path, calls of each form")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared box)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} to run, comma-separated")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="the forms' device")
    parser.add_argument("--code_dir", help="codegen: write each compiled form's output code here")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the step table reports quartiles)")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    if "steps" in parts:
        print_steps(args)
    if "memory" in parts:
        print_memory()
    if "forms" in parts:
        print_forms(device, args.rounds)
    if "codegen" in parts:
        if args.code_dir:
            os.makedirs(args.code_dir, exist_ok=True)
        print_codegen(args.code_dir)


def print_steps(args):
    print(f"ms per training step, seq 256 x 8 sequences, {args.threads} thread(s), {args.rounds} rounds")
    phases = step_phases(args.rounds)
    runs = {key: [r["step"] for r in rounds] for key, rounds in phases.items()}
    starter = {p: min(runs["starter", p]) for p in PATHS}
    print(f"{'model':<9} {'path':<12} {'best':>7} {'median':>7} {'/ starter full':>15} {'/ starter chunked':>18}")
    for (m, p), times in runs.items():
        best = min(times)
        print(
            f"{m:<9} {p:<12} {best:7.0f} {statistics.median(times):7.0f} {best / starter['full logits']:14.2f}x "
            f"{best / starter['chunked']:17.2f}x"
        )
    ratios = sorted(d / s for d, s in zip(runs["default", "chunked"], runs["starter", "chunked"]))
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"default / starter, chunked, round by round: median {statistics.median(ratios):.3f}x "
        f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})"
    )
    print("\nthe chunked step by phase, median ms")
    print(f"{'phase':<13} {'default':>8} {'starter':>8} {'extra':>7}")
    for phase in phases["default", "chunked"][0]:
        d, s = (statistics.median(r[phase] for r in phases[m, "chunked"]) for m in MODELS)
        print(f"{phase:<13} {d:8.1f} {s:8.1f} {d - s:+7.1f}")


def print_memory():
    print("\npeak live MB of one forward + backward, default model, seq 1024 x 8 sequences")
    torch.manual_seed(0)
    model = get_model({**SHAPE, "seq_len": 1024})
    x, y = batch(8, 1024)
    peaks = {p: peak_bytes(model, x, y, head_loss if chunked else None) for p, chunked in PATHS.items()}
    print(f"{'path':<12} {'step':>8} {'head+loss':>10}")
    for p, (step, head) in peaks.items():
        print(f"{p:<12} {step / 2**20:8.0f} {head / 2**20:10.0f}")
    (full_step, full_head), (chunk_step, chunk_head) = peaks.values()
    print(f"cut: step {full_step / chunk_step:.1f}x, head+loss {full_head / chunk_head:.1f}x")


if __name__ == "__main__":
    main()

"""Each SDPA backend at the event's training call (kernels.AttentionCall: q, k, v laid out (B, T, H, D), SDPA given
their transposes, as model.Attention does): forward + backward time, TFLOP/s and agreement with the math backend;
then what a run on this device chooses (kernels.choose_attention, checked eagerly here) and the attention op a
compiled graph calls under that choice (what step 0's trace bakes in)

    python bench/attention_backends.py [--device cuda] [--batch 13] [--heads 8] [--seq 1024] [--head_dim 128]

The event's shape is micro-batch 13 (or fewer: the plan's), 8 heads of 128, seq 1024, bf16, causal. TFLOP/s counts
6 x B x heads x seq^2 x head_dim per forward + backward, plan.flops_per_token's attention term. The error is
kernels.attention_error: the largest relative error (Frobenius norm) of the output and the three input gradients
against the math backend in float32 on the same bf16 inputs; the run's check refuses a backend above
kernels.ATTENTION_TOLERANCE.
"""

import argparse
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from kernels import (  # noqa: E402
    ATTENTION_BACKENDS,
    ATTENTION_TOLERANCE,
    AttentionCall,
    attention_error,
    choose_attention,
    first_sentence,
    sdpa_with_grads,
    training_attention,
)


def timed_ms(backend, q, k, v, grad, reps, device):
    """Median milliseconds of one forward + backward through one backend, after two warm-up calls."""
    times = []
    for i in range(reps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        sdpa_with_grads(backend, q, k, v, grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def compiled_ops(choice, q, k, v):
    """The aten attention ops in the forward graph torch.compile traces under the choice for the training call on these
    (B, T, H, D) q, k, v; none: math, decomposed."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    found = []

    def capture(graph, example_inputs):
        found.extend(str(n.target) for n in graph.graph.nodes if "scaled_dot_product" in str(n.target))
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    compiled = torch.compile(
        training_attention, backend=aot_autograd(fw_compiler=capture), fullgraph=True, dynamic=False
    )
    with choice.active():
        compiled(*(t.detach().requires_grad_() for t in (q, k, v)))
    torch._dynamo.reset()
    return ", ".join(dict.fromkeys(found)) or "none (math, decomposed into matmuls)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=13, help="sequences: the event's micro-batch")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20, help="timed forward + backward calls per backend")
    args = parser.parse_args()
    device = torch.device(args.device)
    call = AttentionCall(args.batch, args.seq, args.heads, args.head_dim, device)
    q, k, v, grad = call.tensors()
    flops = 6 * args.batch * args.heads * args.seq**2 * args.head_dim
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"causal SDPA forward + backward at the training call, {call.words()}, on {where}, torch "
        f"{torch.__version__}, median of {args.reps}"
    )
    print("| backend | ms fwd+bwd | TFLOP/s | error vs math fp32 | |")
    print("| --- | --- | --- | --- | --- |")
    for name, backend in ATTENTION_BACKENDS.items():
        try:
            error = attention_error(backend, q, k, v, grad)
            ms = timed_ms(backend, q, k, v, grad, args.reps, device)
        except (RuntimeError, NotImplementedError) as e:
            print(f"| {name} | - | - | - | does not run here: {first_sentence(e)} |")
            continue
        verdict = "agrees" if error <= ATTENTION_TOLERANCE else f"DISAGREES (> {ATTENTION_TOLERANCE:g})"
        print(f"| {name} | {ms:.3g} | {flops / ms / 1e9:.3g} | {error:.2e} | {verdict} |")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    choice = choose_attention("auto", call, capability, cudnn)
    print(f"\nthe run's choice here (capability {capability}): {choice.label}, op {choice.op}")
    for note in choice.notes:
        print(f"  {note}")
    print(f"compiled under it, the forward graph calls: {compiled_ops(choice, q, k, v)}")


if __name__ == "__main__":
    main()

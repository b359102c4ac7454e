"""The training loss: the head's matmul and cross-entropy a chunk of rows at a time, never the (N, V) logits.

    _, loss = model(idx, targets, loss_fn=head_loss)    # what train.py's micro-steps and validation call

model.forward's own logits path is what the organizers score with; this is the same loss, faster and without
the (B, T, V) float32 logits (4 GB a micro-batch at the event). Imported by train.py's side only: model.py stays
torch + stdlib for the organizers.
"""

import functools
import math

import torch


LOG2E = 1 / math.log(2)


def chunk_loss(y, targets, mix, cap, need_grad):
    """The loss math of one chunk, in place: y (rows, V), the head matmul's output as HeadLoss scales it (capped:
    -2/cap times x @ weight.T; uncapped: log2(e) times it), in the matmul's dtype, upcast to float32 first; targets
    (rows, 1), each row's next token; mix (rows, 1), 1 where the target counts and 0 where it is ignored.
    Returns the row losses (cross-entropies, 0 where ignored), the row sums of the exps and, with need_grad,
    the rows' loss gradients by x @ weight.T in y's dtype, each times its row sum over HeadLoss's slope. Eagerly
    each op is one pass over the chunk, in place where it can be: on CPU the sigmoid's and exp2's arithmetic bounds
    them, so fewer passes would not pay (BENCHMARKS.md).
    Compiled, inductor must realise exp2 (on CPU the sigmoid too) as a float32 chunk for the scatter and write back
    into y: fine where arithmetic bounds it (CPU), ~6x the bytes of functional_chunk_loss where bytes do (CUDA)."""
    dtype = y.dtype
    y = y.to(torch.promote_types(dtype, torch.float32))
    if cap:
        s = y.sigmoid_()
        z = s * (-2 * cap * LOG2E)
    else:
        z = y.sub_(y.amax(1, keepdim=True))
    target_logit = z.gather(1, targets) * mix / LOG2E
    e = z.exp2_()
    total = e.sum(1, keepdim=True)
    row_loss = (total.log() - target_logit).squeeze(1)
    if not need_grad:
        return row_loss, total, None
    # d loss_row / d logits = softmax - the target's one-hot = (e - total * one-hot) / total; the 1/total is left to
    # the caller
    g = e.scatter_add_(1, targets, -total * mix)
    if cap:
        g = torch.ops.aten.sigmoid_backward.grad_input(g, s, grad_input=s)  # s is not needed again
    return row_loss, total, g.to(dtype)


def functional_chunk_loss(y, targets, mix, cap, need_grad):
    """chunk_loss's math and contract, written for inductor: no in-place op, the target logits gathered from y (a
    column each), the one-hots comparisons with the column index instead of a scatter, y upcast inside and g cast
    back inside. So nothing forces a (rows, V) intermediate into memory: compiled for CUDA, it is one reduction pass
    (the row sums of the exps; uncapped, the row max too) and one pointwise pass that writes g in y's dtype
    (BENCHMARKS.md, "Head loss: the functional form"). Eagerly it makes ~2x chunk_loss's passes."""
    acc = torch.promote_types(y.dtype, torch.float32)
    if cap:
        s = y.to(acc).sigmoid()
        z = s * (-2 * cap * LOG2E)
        target_z = y.gather(1, targets).to(acc).sigmoid() * (-2 * cap * LOG2E)
    else:
        top = y.amax(1, keepdim=True).to(acc)
        z = y.to(acc) - top
        target_z = y.gather(1, targets).to(acc) - top
    target_logit = target_z * mix / LOG2E  # rounded as chunk_loss
    e = z.exp2()
    total = e.sum(1, keepdim=True)
    row_loss = (total.log() - target_logit).squeeze(1)
    if not need_grad:
        return row_loss, total, None
    columns = torch.arange(y.size(1), device=y.device)
    one_hots = torch.where(columns == targets, mix, 0.0)  # a comparison inside the one pointwise pass, not a scatter
    g = e - total * one_hots
    if cap:
        g = g * (1 - s) * s  # sigmoid's derivative, in sigmoid_backward's order
    return row_loss, total, g.to(y.dtype)


class HeadLoss(torch.autograd.Function):
    """Mean cross-entropy of cap * tanh(x @ weight.T / cap) (cap 0: of x @ weight.T), a chunk of rows at a time.

    Only one chunk's (rows, V) float32 logits exist at a time. The loss is the last op of the graph, so each chunk's
    gradients are taken in forward, while its logits are at hand (three matmuls in all, no recomputation), and
    backward only scales dx and dweight by the incoming gradient. Every pass over a chunk counts at CPU widths:
    - the cap goes through a sigmoid, cap * tanh(y) = cap - 2cap * sigmoid(-2y): a third of tanh's cost on CPU, it
      bounds the logits (no max pass), the softmax ignores the shift, and its derivative 4 s (1 - s) is one fused
      sigmoid_backward pass with the softmax gradient;
    - logits are kept in base 2 (scaled by log2(e), folded into a scalar that is applied anyway): exp2 is ~half
      the cost of exp on CPU.
    Targets -100 are left out of the mean, as F.cross_entropy does."""

    @staticmethod
    def forward(ctx, x, weight, targets, cap, rows, dtype, need_grad, chunk_fn):
        # x (N, C), weight (V, C), targets (N, 1); dtype is the matmuls' (autocast's), the loss math float32 or wider
        acc = torch.promote_types(dtype, torch.float32)
        valid = targets != -100
        mix = valid.to(acc)
        row_weight = mix.squeeze(1) / valid.sum()  # each row's share of the mean over the counted targets
        targets = targets.masked_fill(~valid, 0)
        w = weight.to(dtype)
        # capped: the matmul gives -2y/cap and s = sigmoid(-2y/cap); the base-2 logits minus their bound are
        # -2cap * log2(e) * s <= 0, so exp2 never overflows. Uncapped: the matmul gives log2(e) * y directly.
        # Either scale goes on the (N, C) input, not the (N, V) logits.
        x_in = (x.to(acc) * (-2 / cap if cap else LOG2E)).to(dtype)
        slope = 4.0 if cap else 1.0  # d logit / dy: 4 s (1 - s) with s(1 - s) from sigmoid_backward; uncapped 1
        row_loss = torch.empty(x.size(0), device=x.device, dtype=acc)
        dx = torch.empty_like(x) if need_grad else None
        dw = torch.zeros_like(weight, dtype=acc) if need_grad else None
        for i in range(0, x.size(0), rows):
            x_c, t_c, mix_c = x_in[i : i + rows], targets[i : i + rows], mix[i : i + rows]
            n = x_c.size(0)
            row_loss[i : i + n], total, g = chunk_fn(torch.mm(x_c, w.t()), t_c, mix_c, cap, need_grad)
            if dx is None or dw is None:  # no gradient wanted
                continue
            scale = slope * row_weight[i : i + n, None] / total  # commutes with the matmuls
            dx[i : i + n] = torch.mm(g, w).mul_(scale)
            x_scaled = (x[i : i + n] * scale).to(dtype)
            if dtype == acc:
                dw.addmm_(g.t(), x_scaled)
            else:  # a bf16 product per chunk, summed in float32
                dw.add_(torch.mm(g.t(), x_scaled))
        ctx.save_for_backward(dx, dw)
        return (row_loss * row_weight).sum()

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        return dx * grad, dw * grad, None, None, None, None, None, None


# float32 logits per head_loss chunk, at most. CPU: the (rows, C) @ (C, V) matmul gains up to ~500 rows (measured at
# C = 128: 64 MB chunks take 0.88-0.95x the time of 16 MB ones, 4 MB ones 1.3x). CUDA: every chunk reads and writes
# the float32 (V, C) weight gradient; at l16w1024, micro-batch 26, 512 MB chunks make 8 chunks (~3 GB of that
# traffic per micro-step) where 64 MB ones made 51 (~20 GB; bench/records/2026-12-01-event-configuration.md).
LOSS_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 512 << 20}


def chunk_rows(n_rows, vocab_size, max_bytes):
    """Rows per head_loss chunk: all of them if they fit in max_bytes of float32 logits, else a multiple of 128
    (tensor-core tiles) that fits, preferring one that divides n_rows (compiled, a ragged last chunk is a graph of
    its own)."""
    cap = max(1, max_bytes // (4 * vocab_size))
    if n_rows <= cap or cap < 128:  # below 128 rows: toy sizes, kept as asked
        return min(n_rows, cap)
    cap -= cap % 128
    for rows in range(cap, cap // 2, -128):
        if n_rows % rows == 0:
            return rows
    return cap


def head_loss(x, weight, targets, cap=0.0, rows=None, chunk_fn=chunk_loss):
    """F.cross_entropy(cap * tanh(x @ weight.T / cap), targets) (cap 0: no cap) for x (N, C), weight (V, C) and
    targets (N,) or (B, T) windows of B * T = N tokens, never holding the (N, V) logits. rows: tokens per chunk; by
    default chunk_rows under LOSS_CHUNK_BYTES. chunk_fn: chunk_loss, or its compiled form."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    rows = rows or chunk_rows(x.size(0), weight.size(0), LOSS_CHUNK_BYTES.get(device, LOSS_CHUNK_BYTES["cpu"]))
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return HeadLoss.apply(x, weight, targets.long().reshape(-1, 1), cap, rows, dtype, need_grad, chunk_fn)


# The form a compiled run traces, by device. CUDA: bytes bound the loss math, and the functional form moves ~6x fewer
# (two passes over a bf16 chunk against float32 buffers written and re-read). CPU: the sigmoid's and exp2's arithmetic
# bounds it, and compiled for the CPU the functional form computes exp2 twice: 1.24x the in-place form's time at
# float32, capped (BENCHMARKS.md, "Head loss: the functional form").
TRACED_FORMS = {"cuda": functional_chunk_loss}


def compiled_chunk_loss(y, targets, mix, cap, need_grad):
    """What compiled_head_loss compiles: the device's TRACED_FORMS entry when traced (chunk_loss if none), chunk_loss
    when it runs eagerly (the step-0 fallback and guard misses run under the force_eager stance), where the in-place
    form makes fewer passes."""
    if torch.compiler.is_compiling():
        return TRACED_FORMS.get(y.device.type, chunk_loss)(y, targets, mix, cap, need_grad)
    return chunk_loss(y, targets, mix, cap, need_grad)


def compiled_head_loss(wrap=lambda fn: fn):
    """head_loss with its per-chunk loss math compiled (eagerly, one pass over the (rows, V) logits per op,
    bandwidth-bound on GPU); wrap: what the compiled function runs inside (kernels.EagerRuns.wrap)."""
    compiled = torch.compile(compiled_chunk_loss, fullgraph=True, dynamic=False)
    return functools.partial(head_loss, chunk_fn=wrap(compiled))


def chunk_graphs(micro_tokens, vocab_rows, device_type):
    """Graphs the compiled chunk_loss makes at micro_tokens rows per call: one per chunk shape."""
    rows = chunk_rows(micro_tokens, vocab_rows, LOSS_CHUNK_BYTES.get(device_type, LOSS_CHUNK_BYTES["cpu"]))
    return 1 if micro_tokens % rows == 0 else 2

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


def chunk_loss(y, targets, cap, need_grad):
    """The loss math of one chunk, float32, in place on y (rows, V): the head matmul's output as HeadLoss scales it
    (capped: -2/cap times x @ weight.T; uncapped: log2(e) times it). Returns the row losses, the row sums of the
    exps and, with need_grad, the rows' loss gradients by x @ weight.T, each times its row sum over HeadLoss's slope.
    A function of its own so that compiled runs fuse its passes (GPT.compile_per_block); eagerly, each is a pass of
    its own over the chunk (bandwidth-bound on GPU; on CPU the sigmoid's and exp2's arithmetic bounds them)."""
    if cap:
        s = y.sigmoid_()
        z = s * (-2 * cap * LOG2E)
    else:
        z = y.sub_(y.amax(1, keepdim=True))
    target_logit = z.gather(1, targets) / LOG2E
    e = z.exp2_()
    total = e.sum(1, keepdim=True)
    row_loss = (total.log() - target_logit).squeeze(1)
    if not need_grad:
        return row_loss, total, None
    # d loss_row / d logits = softmax - onehot = (e - total * onehot) / total; the 1/total is left to the caller
    g = e.scatter_add_(1, targets, -total)
    if cap:
        g = torch.ops.aten.sigmoid_backward.grad_input(g, s, grad_input=s)  # s is not needed again
    return row_loss, total, g


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
        # x (N, C), weight (V, C), targets (N,); dtype is the matmuls' (autocast's), the loss math float32 or wider
        acc = torch.promote_types(dtype, torch.float32)
        valid = targets != -100
        row_weight = valid.to(acc) / valid.sum()  # the mean over counted rows, as F.cross_entropy takes it
        targets = targets.masked_fill(~valid, 0)[:, None]
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
            x_c, t_c = x_in[i : i + rows], targets[i : i + rows]
            n = x_c.size(0)
            row_loss[i : i + n], total, g = chunk_fn(torch.mm(x_c, w.t()).to(acc), t_c, cap, need_grad)
            if not need_grad:
                continue
            g = g.to(dtype)
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
    targets (N,), never holding the (N, V) logits. rows: tokens per chunk; by default chunk_rows under LOSS_CHUNK_BYTES.
    chunk_fn: chunk_loss, or its compiled form."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    rows = rows or chunk_rows(x.size(0), weight.size(0), LOSS_CHUNK_BYTES.get(device, LOSS_CHUNK_BYTES["cpu"]))
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return HeadLoss.apply(x, weight, targets.long(), cap, rows, dtype, need_grad, chunk_fn)


def compiled_head_loss(wrap=lambda fn: fn):
    """head_loss with its per-chunk loss math compiled (eagerly, one pass over the (rows, V) logits per op,
    bandwidth-bound on GPU); wrap: what the compiled function runs inside (launch.EagerRuns.wrap)."""
    return functools.partial(head_loss, chunk_fn=wrap(torch.compile(chunk_loss, fullgraph=True, dynamic=False)))


def chunk_graphs(micro_tokens, vocab_rows, device_type):
    """Graphs the compiled chunk_loss makes at micro_tokens rows per call: one per chunk shape."""
    rows = chunk_rows(micro_tokens, vocab_rows, LOSS_CHUNK_BYTES.get(device_type, LOSS_CHUNK_BYTES["cpu"]))
    return 1 if micro_tokens % rows == 0 else 2

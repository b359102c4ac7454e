"""The speedrun GPT: one file, torch + stdlib only (the organizers import it alone).

    ckpt = torch.load("checkpoint.pt", weights_only=True)
    model = get_model(ckpt["config"]); model.load_state_dict(ckpt["model"])
    logits, loss = model(idx, targets)

Every modded-nanogpt trick below is a few lines behind a config key, so benchmarks can ablate it.
Nothing here depends on the training length: RoPE is computed for whatever T arrives.
"""

import math
from dataclasses import dataclass, fields
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F


class SoftCap(torch.autograd.Function):
    """cap * tanh(z) over the (B, T, V) logits with one saved tensor and a two-pass backward. Eager autograd
    keeps tanh's output and its scaled copy and allocates two full-size gradients; at CPU widths those passes
    over the 32K-wide logits cost as much as the matmuls. Compiled, the same math fuses either way."""

    @staticmethod
    def forward(ctx, z, cap):
        out = torch.tanh(z).mul_(cap)
        ctx.save_for_backward(out)
        ctx.cap = cap
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        # d(cap * tanh z)/dz = cap * (1 - tanh^2 z) = cap - out^2 / cap
        return torch.addcmul(out.new_full((), ctx.cap), out, out, value=-1.0 / ctx.cap).mul_(grad), None


# Each switch's source and its effect here. "mnGPT #N": record N of github.com/KellerJordan/modded-nanogpt's world
# record table. "Here": the 5-minute CPU ablation (l4w128, commit 4b2f1ef; BENCHMARKS.md, "Recipe variants at equal
# wall-clock"): val loss with the switch changed minus the default's, so + means the default's choice scored better;
# differences under ~0.05 nats are ties (seed noise 0.02-0.05).
@dataclass
class GPTConfig:
    vocab_size: int = 32000
    seq_len: int = 1024  # training length; only the "learned" position table is bounded by it
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768
    mlp_ratio: int = 4
    # RMSNorm: Zhang & Sennrich 2019, arXiv:1910.07467; gain-free in mnGPT. Here: not measured (starter bundle only)
    norm: str = "rms"  # "rms" (no gains, cheapest) or "layer" (starter-style baseline)
    # RoPE: Su et al. 2021 (RoFormer), arXiv:2104.09864; mnGPT #2. Here: not measured (the starter bundle only)
    pos: str = "rope"  # "rope" (any length) or "learned" (starter-style, T <= seq_len)
    rope_base: float = 10000.0
    # QK-norm: Dehghani 2023, arXiv:2302.05442; Wortsman 2023, arXiv:2309.14322; mnGPT #5. Here: off -0.012 (tie)
    qk_norm: bool = True  # bounded attention logits: stable at the high LRs Muon wants
    # ReLU^2: So et al. 2021 (Primer), arXiv:2109.08668; mnGPT #5. Here: gelu -0.096 (0.79M block params; GPU: re-test)
    mlp_act: str = "relu2"  # "relu2" (sparse, better per FLOP in speedruns) or "gelu"
    # tanh soft-cap: Gemma 2, arXiv:2408.00118; mnGPT #9 (cap 30), #18 (15). Here: off -0.240 (CPU steps: 197 vs 134)
    logit_softcap: float = 15.0  # 0 disables; tanh cap keeps early logits from exploding
    # value embeddings: mnGPT #14, U-net layout #15 (after Zhou et al. 2024, arXiv:2410.17897). Here: off +0.022
    value_embeds: bool = True  # token-indexed tables mixed into V of the first/last layers
    # embedding shortcut (x0 lambdas): mnGPT #9. Here: off -0.016
    x0_mix: bool = True  # every block sees the embedding again: a shortcut for token identity
    # learnable residual lambda: mnGPT #9 (lambdas[0], beside the x0 shortcut). Here: off -0.020
    resid_scale: bool = True  # learnable per-block residual scale
    # U-Net skips: mnGPT #11 (after Ronneberger et al. 2015, arXiv:1505.04597). Here: off +0.046
    unet_skips: bool = True  # mirrored encoder->decoder skips with learnable weights
    # zero-init projections (muP-like): mnGPT #5. Here: off -0.037
    zero_init_proj: bool = True  # blocks start as identity, so depth adds no early noise
    # embedding RMS norm: mnGPT's F.rms_norm on wte (@Grad62304977). Here: off -0.068 (just outside the noise)
    embed_norm: bool = True  # RMS-normalise the embedding so its scale is not a free knob
    # tying: Press & Wolf 2017, arXiv:1608.05859; mnGPT #8 untied them. Here: tied +0.003
    tie_embeddings: bool = False  # untied is better in speedruns; tied halves embedding params
    # --- later short-track wins. "Here": at 100 steps x 2,048 tokens, l4w128, val loss with the switch on
    # minus without, same seed (BENCHMARKS.md, "The current record's model"); "medium #N": the medium track's table ---
    # bigram hash embedding: mnGPT #62 (2026-01-19, 7.5 x vocab rows; not in medium #18). Here: -0.056 (3 seeds, all
    # wins); with backout and the value-embedding gate, the adopted set: -0.062 (3 seeds, all wins)
    bigram_mult: float = 5.0  # a zero-init table of this x vocab_size rows, indexed by a hash of (previous, current)
    # smear: mnGPT #34 (2025-09-18), medium #16 and #18. Here: -0.017 (3 seeds; a tie), off: not in the measured set
    smear: bool = False  # the previous position's embedding mixed in through a gated scalar
    # sparse attention gate: mnGPT #28 (2025-08-23), medium #18. Here: +0.027 (3 seeds; leaning worse)
    attn_gate: bool = False  # per-head sigmoid gate on attention's output, from the block input's first dims
    # value-embedding gate: mnGPT #55 (2025-12-29), medium #18. Here: +0.001 (3 seeds; a tie the record carries)
    ve_gate: bool = True  # per-head 2 sigmoid gate on the value embedding, from the same dims
    # backout: mnGPT #40 (2025-10-04), medium #15 and #18. Here: -0.005 (3 seeds; a tie the record carries)
    backout: bool = True  # subtract a learned fraction of layer 3L/4's residual before the head
    # tied, then split: mnGPT #53 (2025-12-22, at 2/3), medium #18 (its code: 1/6). Here: +0.036 at 2/3 (3 seeds)
    untie_at: float = 0.0  # share embedding and head until this fraction of training (train.py's progress); 0: off
    # the gates' AdamW LR as a fraction of scalar_lr (optimizers.build_optimizers; medium #18 gives gates 0.1x)
    gate_lr_mult: float = 0.1
    # MUDD: Xiao et al. 2025, arXiv:2502.12170; mnGPT medium PR #261 (-470 of 4,740 steps). Here: +0.0004 at 200 steps
    # of l8w128 (3 seeds; a tie the record carries; BENCHMARKS.md, "MUDD, Snoo and update smoothing")
    mudd: bool = True  # the last two blocks' inputs and the head's get per-token mixes of earlier outputs (DenseMix)


GATE_DIM = 12  # the gates read the first dims of their input (mnGPT: 12 on the short track, 16 on the medium)
MUDD_HIDDEN, MUDD_SCALE = 64, 0.2 / math.sqrt(3)  # medium PR #261's width and output scale (it slows Adam's moves)


def bigram_hash(idx, rows):
    """Row of each (previous, current) token pair in a table of `rows`; a window's first position, whose previous
    token is not in the window, gets the last row (a pad: one kernel, where a filled column and a concatenation took
    two). Multiply-xor (mnGPT's constants) spreads pairs over the rows."""
    idx = idx.long()
    pairs = torch.bitwise_xor(36313 * idx[:, 1:], 27191 * idx[:, :-1]) % (rows - 1)
    return F.pad(pairs, (1, 0), value=rows - 1)


class ScaledAdd(torch.autograd.Function):
    """x + w * s for a 0-d weight w: the eager glue between compiled blocks, where every op is a kernel launch.
    Forward is one addcmul; backward two ops (a dot product for w, a scale for s) where autograd's addcmul takes
    five and a multiply-add three."""

    @staticmethod
    def forward(ctx, x, w, s):
        ctx.save_for_backward(w, s)
        return torch.addcmul(x, w, s)

    @staticmethod
    def backward(ctx, grad):
        w, s = ctx.saved_tensors
        grad_w = torch.dot(grad.reshape(-1), s.reshape(-1).to(grad.dtype)).view_as(w) if w.requires_grad else None
        return grad, grad_w, grad * w


def scaled_add(x, w, s):
    """x + w * s: ScaledAdd eagerly; inside a compiled graph (which fuses it anyway, and cannot trace a Function
    given one tensor twice: the first U-Net skip is x itself) the plain expression."""
    return x + w * s if torch.compiler.is_compiling() else ScaledAdd.apply(x, w, s)


class SparseAfterFirst(torch.autograd.Function):
    """F.embedding whose backward is dense while the table has no .grad and sparse once it has (lookup)."""

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx, weight)
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):
        idx, weight = ctx.saved_tensors
        if weight.grad is None or weight.grad.is_sparse:
            return None, torch.ops.aten.embedding_dense_backward(grad, idx, weight.size(0), -1, False)
        rows = looked_up_rows if grad.is_cuda else summed_rows  # torch.unique's size costs CUDA a host sync
        return None, rows(grad, idx, weight.size(0))


def looked_up_rows(grad, idx, n_rows):
    return torch.ops.aten.embedding_sparse_backward(grad, idx, n_rows, -1, False)


def summed_rows(grad, idx, n_rows):
    """Each row's gradients summed first, in the dense backward's order, then added once: the sums a dense gradient
    holds, so one process accumulating micro-steps matches any number of ranks bit for bit."""
    rows, where = torch.unique(idx, return_inverse=True)
    values = grad.new_zeros(rows.numel(), grad.size(-1)).index_add_(0, where.flatten(), grad.flatten(0, -2))
    shape = (n_rows, grad.size(-1))
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, is_coalesced=True, check_invariants=False)


def lookup(table, idx):
    """table(idx). Once a micro-step's backward has left a dense .grad on the table, later micro-steps add only the
    rows looked up into it (a dense lookup gradient zero-fills and adds the whole table: 2.6 GB a micro-step for the
    bigram table at the event). Decided at backward, so a loop that zeroes .grad before backward stays dense; the
    first micro-step is dense, as DDP's buckets and fused AdamW need; compiled graphs keep plain F.embedding."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return F.embedding(idx, table.weight)
    return SparseAfterFirst.apply(idx, table.weight)


def gate_linear(cfg, n_out, on):
    """A zero-init (GATE_DIM -> n_out) linear map (sigmoid 0.5 at init), or None when its switch is off."""
    return nn.Linear(min(GATE_DIM, cfg.n_embd), n_out, bias=False) if on else None


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


class DenseMix(nn.Module):
    """MUDD's dynamic weights (Xiao et al. 2025): per token, n_out numbers from a GELU MLP on the normalised hidden
    state (the paper normalises; the PR reads it raw). The output layer starts at zero: a mix starts as nothing. Its
    own compiled graph when the blocks are compiled (compile_per_block), so its passes fuse."""

    def __init__(self, dim, n_out):
        super().__init__()
        self.w1 = nn.Linear(dim, MUDD_HIDDEN, bias=False)
        self.w2 = nn.Linear(MUDD_HIDDEN, n_out)

    def weights(self, x):
        return self.w2(F.gelu(self.w1(rms_norm(x)))) * MUDD_SCALE


class MiddleMix(DenseMix):
    """After block L-2: its output x, x0 and a tap mixed into the last block's input and, through its value-embedding
    input (so the block keeps its graph), into its V, the value embedding gated per head first (1 at init)."""

    def forward(self, x, x0, tap, ve):
        w, sources = self.weights(x), (x0, tap, x)
        if ve is not None:
            B, T, C = ve.shape
            gate = w[..., 6:, None] + 1.0
            ve = mixed((ve.view(B, T, -1, C // gate.size(-2)) * gate).view(B, T, C), w[..., 3:6], sources)
        return mixed(x, w[..., :3], sources), ve


class LastMix(DenseMix):
    """After block L-1: the sources mixed into the head's input."""

    def forward(self, x, *sources):
        return mixed(x, self.weights(x), sources)


def mixed(x, weights, sources):
    """x + sum_j weights[..., j] * sources[j]: one addcmul a source."""
    for j, source in enumerate(sources):
        x = torch.addcmul(x, weights[..., j : j + 1], source)
    return x


class ReluSquared(torch.autograd.Function):
    """relu(h)^2 with a two-pass backward, 2 relu(h) g: the relu's own mask is implied (relu(h) is 0 there).
    Autograd of relu().square() takes four passes: pow's backward copies, scales and multiplies, then the mask."""

    @staticmethod
    def forward(ctx, h):
        r = F.relu(h)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return torch.mul(grad, r).mul_(2)


class Norm(nn.Module):
    """RMSNorm without gains (modded-nanogpt) or LayerNorm (the starter's baseline)."""

    def __init__(self, dim, kind):
        super().__init__()
        if kind not in ("rms", "layer"):
            raise ValueError(f"config norm must be 'rms' or 'layer', got {kind!r}")
        self.layer = nn.LayerNorm(dim) if kind == "layer" else None

    def forward(self, x):
        return self.layer(x) if self.layer is not None else rms_norm(x)


class Rotary(nn.Module):
    """RoPE tables for whatever T arrives, made once per length and device (11 small kernels a forward otherwise) and
    kept outside the state_dict. The compiled blocks take them as inputs, so every call passes the same tensors.
    Shaped (T, 1, head_dim) for q and k laid out (B, T, H, D), and full-width (cos twice, sin then -sin) so
    apply_rotary is one multiply-add."""

    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.tables = {}

    def forward(self, T, device):
        if torch.compiler.is_compiling():  # a whole-model graph computes them inside itself
            return self.make(T, device)
        key = (T, str(device), torch.is_inference_mode_enabled())  # an inference tensor cannot be saved for backward
        if key not in self.tables:
            with torch.no_grad():
                self.tables[key] = self.make(T, device)
        return self.tables[key]

    def make(self, T, device):
        arange = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = self.base ** (-arange / self.head_dim)
        freqs = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)[:, None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, -sin), dim=-1)


def apply_rotary(x, cos, sin):
    """Rotate each (x1, x2) pair of x (B, T, H, D) by its position's angle: (x1 cos + x2 sin, x2 cos - x1 sin),
    as x * cos + (x2, x1) * sin with Rotary's full-width tables."""
    xf = x.float()
    return torch.addcmul(xf * cos, xf.roll(x.size(-1) // 2, dims=-1), sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg, has_value_embed):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qk_norm = cfg.qk_norm
        # separate q/k/v matrices so Muon orthogonalises each one on its own
        self.c_q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        # v = a*v + b*ve; half-and-half start lets either side take over
        self.ve_lambdas = nn.Parameter(torch.tensor([0.5, 0.5])) if has_value_embed else None
        self.attn_gate = gate_linear(cfg, self.n_head, cfg.attn_gate)
        self.ve_gate = gate_linear(cfg, self.n_head, cfg.ve_gate and has_value_embed)

    def forward(self, x, ve, rope):
        B, T, C = x.shape
        # (B, T, H, D) until attention: the norm and rotation then run on contiguous rows, no copies
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_head, self.head_dim)
        if self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if ve is not None:
            assert self.ve_lambdas is not None, "a value embedding reached a block built without one"
            ve = ve.view_as(v).type_as(v)
            if self.ve_gate is not None:  # 2 sigmoid: 1 at init, so the gate starts as the ungated sum
                ve = ve * 2 * torch.sigmoid(self.ve_gate(x[..., :GATE_DIM]))[..., None]
            v = self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = y.transpose(1, 2)
        if self.attn_gate is not None:  # a head can output ~nothing where its context has nothing to add
            y = y * torch.sigmoid(self.attn_gate(x[..., :GATE_DIM]))[..., None]
        return self.c_proj(y.reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.mlp_act not in ("relu2", "gelu"):
            raise ValueError(f"config mlp_act must be 'relu2' or 'gelu', got {cfg.mlp_act!r}")
        self.relu2 = cfg.mlp_act == "relu2"
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        h = self.c_fc(x)
        h = ReluSquared.apply(h) if self.relu2 else F.gelu(h)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg, has_value_embed):
        super().__init__()
        self.norm1, self.norm2 = Norm(cfg.n_embd, cfg.norm), Norm(cfg.n_embd, cfg.norm)
        self.attn = Attention(cfg, has_value_embed)
        self.mlp = MLP(cfg)
        self.resid_lambda = nn.Parameter(torch.ones(())) if cfg.resid_scale else None
        self.x0_lambda = nn.Parameter(torch.zeros(())) if cfg.x0_mix else None  # starts off

    def forward(self, x, x0, ve, rope):
        if self.resid_lambda is not None:
            x = self.resid_lambda * x
        if self.x0_lambda is not None:
            x = x + self.x0_lambda * x0
        x = x + self.attn(self.norm1(x), ve, rope)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
            raise ValueError(f"n_embd={cfg.n_embd} must split into n_head={cfg.n_head} heads of even size")
        if cfg.pos not in ("rope", "learned"):
            raise ValueError(f"config pos must be 'rope' or 'learned', got {cfg.pos!r}")
        if cfg.untie_at and (cfg.tie_embeddings or not 0 < cfg.untie_at < 1):
            raise ValueError(f"config untie_at must be in (0, 1) with tie_embeddings off, got {cfg.untie_at}")
        if not 0 <= cfg.bigram_mult < math.inf:
            raise ValueError(f"config bigram_mult must be a finite number >= 0 (0: off), got {cfg.bigram_mult}")
        if not (cfg.mlp_ratio >= 1 and cfg.rope_base > 1 and 0 <= cfg.logit_softcap < math.inf):
            raise ValueError(
                f"config mlp_ratio must be >= 1, rope_base > 1 and logit_softcap a finite number >= 0, got "
                f"{cfg.mlp_ratio}, {cfg.rope_base}, {cfg.logit_softcap}"
            )
        self.config = cfg
        L, C = cfg.n_layer, cfg.n_embd
        self.padded_vocab = 128 * math.ceil(cfg.vocab_size / 128)  # tensor-core friendly head
        self.wte = nn.Embedding(self.padded_vocab, C)
        self.wpe = nn.Embedding(cfg.seq_len, C) if cfg.pos == "learned" else None
        self.rotary = Rotary(C // cfg.n_head, cfg.rope_base) if cfg.pos == "rope" else None
        self.embed_norm = Norm(C, cfg.norm) if cfg.embed_norm else None
        self.bigram = nn.Embedding(max(2, int(cfg.bigram_mult * cfg.vocab_size)), C) if cfg.bigram_mult else None
        # mnGPT injects it at 0.05 (learned): a row that Adam moved at the embedding LR after one hit would drown the
        # normalised token embedding (measured: without the scale, +0.100 at seed 0 instead of a gain)
        self.bigram_lambda = nn.Parameter(torch.tensor(0.05)) if cfg.bigram_mult else None
        self.smear_gate = gate_linear(cfg, 1, cfg.smear)
        self.smear_lambda = nn.Parameter(torch.zeros(())) if cfg.smear else None
        # value embeddings: table k feeds layer k and layer L-n_ve+k (modded-nanogpt uses 3 tables)
        n_ve = min(3, L // 2) if cfg.value_embeds else 0
        self.value_embeds = nn.ModuleList(nn.Embedding(self.padded_vocab, C) for _ in range(n_ve))
        self.ve_index: list[int | None] = [None] * L
        for k in range(n_ve):
            self.ve_index[k] = self.ve_index[L - n_ve + k] = k
        self.blocks = nn.ModuleList(Block(cfg, self.ve_index[i] is not None) for i in range(L))
        # U-Net: decoder layer L-1-k receives encoder layer k's output, weighted
        self.n_skip = L // 2 if cfg.unet_skips else 0
        self.skip_weights = nn.Parameter(torch.ones(self.n_skip)) if self.n_skip else None
        # l16: layer 11's output, as medium #18; none for one layer (the last output minus a share of itself is the same
        # direction, which norm_f undoes)
        self.backout_layer = 3 * L // 4 - 1 if cfg.backout and 0 <= 3 * L // 4 - 1 < L - 1 else None
        self.backout_lambda = nn.Parameter(torch.tensor(0.5)) if self.backout_layer is not None else None
        self.tied = cfg.untie_at > 0  # set_progress clears it; only the optimizer's hooks read it
        self.norm_f = Norm(C, cfg.norm)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(C, self.padded_vocab, bias=False)
        self._init_weights()
        # built last: the other weights draw as without it; none for one layer (no block before the last to mix from)
        self.mudd = self._dense_mixes() if cfg.mudd and cfg.n_layer >= 2 else None

    def _dense_mixes(self):
        """MUDD as medium PR #261 trims it: after block L-2 (MiddleMix) x0, a tap at 3L/4 (the backout layer's) and the
        block's output; after block L-1 (LastMix) x0, the taps at 3L/4 and L/4, block L-2's output and value embedding
        0. The PR's six per-token scalars of the last block are left out (they would make it a graph of its own);
        backout stays its own scalar."""
        cfg, L = self.config, self.config.n_layer
        self.mudd_taps = (max(3 * L // 4 - 1, 0), L // 4)
        n_mid = 3 + (3 + cfg.n_head) * (self.ve_index[L - 1] is not None)
        mixes = (MiddleMix(cfg.n_embd, n_mid), LastMix(cfg.n_embd, 4 + bool(self.value_embeds)))
        with torch.no_grad():
            for mix in mixes:
                mix.w1.weight.normal_(0.0, 0.5 / math.sqrt(cfg.n_embd))
                mix.w2.weight.zero_()
                mix.w2.bias.zero_()
        return nn.ModuleList(mixes)

    @torch.no_grad()
    def _init_weights(self):
        cfg = self.config
        blocks = cast(list[Block], self.blocks)
        for block in blocks:
            for m in block.modules():
                if isinstance(m, nn.Linear):  # unit-RMS input -> O(0.5) output
                    m.weight.normal_(0.0, 0.5 / math.sqrt(m.in_features))
            if cfg.zero_init_proj:
                block.attn.c_proj.weight.zero_()
                block.mlp.c_proj.weight.zero_()
        # the input embedding is normalised, so its scale only matters when it doubles as the head
        self.wte.weight.normal_(0.0, 0.02 if cfg.tie_embeddings or cfg.untie_at else 1.0)
        if self.wpe is not None:
            self.wpe.weight.normal_(0.0, 0.02)
        for ve in cast(list[nn.Embedding], self.value_embeds):
            ve.weight.normal_(0.0, 0.5)  # the scale of v at init
        gates = [g for b in blocks for g in (b.attn.attn_gate, b.attn.ve_gate)] + [self.smear_gate, self.bigram]
        for g in gates:  # zero: the gates start at sigmoid 0.5 (2 sigmoid: 1), the bigram table adds nothing
            if g is not None:
                g.weight.zero_()
        if self.lm_head is not None and cfg.untie_at:  # one weight until the split: the head starts as the embedding
            self.lm_head.weight.copy_(self.wte.weight)
        elif self.lm_head is not None:
            if cfg.zero_init_proj:
                self.lm_head.weight.zero_()  # initial loss is exactly ln(V)
            else:
                self.lm_head.weight.normal_(0.0, 0.02)

    def _embed(self, idx):
        """The residual stream's start: token embedding (+ learned positions), normalised, bigram rows, the smear."""
        T = idx.size(1)
        x = lookup(self.wte, idx)
        if self.wpe is not None:
            if T > self.config.seq_len:
                raise ValueError(f"pos='learned' supports T <= seq_len={self.config.seq_len}, got T={T}")
            x = x + self.wpe(torch.arange(T, device=idx.device))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.bigram is not None:
            rows = lookup(self.bigram, bigram_hash(idx, self.bigram.num_embeddings))
            x = scaled_add(x, self.bigram_lambda, rows)
        if self.smear_gate is not None and self.smear_lambda is not None:  # t also sees t-1's, through a gate read at t
            smear = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :GATE_DIM]))
            x = torch.cat([x[:, :1], x[:, 1:] + smear * x[:, :-1]], dim=1)
        return x

    def forward(self, idx, targets=None, loss_fn=None):
        """(logits, loss), loss None without targets. With loss_fn(x, head_weight, targets, logit_softcap) -> mean
        loss (training's headloss.head_loss, which never holds the (B, T, V) logits; targets as given, (B, T), so it
        can tell the windows apart): (None, loss). A keyword, so DDP's wrapper of forward carries it."""
        if loss_fn is not None and targets is None:
            raise ValueError("forward(loss_fn=...) returns the loss alone, so it needs targets")
        B, T = idx.shape
        cfg = self.config
        x = self._embed(idx)
        # a copy, not an alias: compiled blocks guard on `x is x0`, and block 0 would be a graph of its own
        x0, x = x, x.clone()
        rope = self.rotary(T, idx.device) if self.rotary is not None else None
        ves = [lookup(ve, idx) for ve in self.value_embeds]
        L, early, mixed_ve = len(self.blocks), None, None
        skips: list[torch.Tensor] = []
        taps: dict[int | str, torch.Tensor] = {}  # MUDD's sources
        # one backward op, not one per skip
        skip_weights = self.skip_weights.unbind() if self.skip_weights is not None else ()
        for i, block in enumerate(self.blocks):
            if i >= L - self.n_skip:
                x = scaled_add(x, skip_weights[L - 1 - i], skips.pop())
            k = self.ve_index[i]
            ve = ves[k] if k is not None else None
            x = block(x, x0, mixed_ve if i == L - 1 and mixed_ve is not None else ve, rope)
            if i < self.n_skip:
                skips.append(x)
            if i == self.backout_layer:
                early = x
            if self.mudd is not None and i in self.mudd_taps:
                taps[i] = x
            if self.mudd is not None and i == L - 2:
                last_ve, taps["L-2"] = self.ve_index[L - 1], x
                x, mixed_ve = self.mudd[0](
                    x, x0, taps[self.mudd_taps[0]], ves[last_ve] if last_ve is not None else None
                )
        if early is not None and self.backout_lambda is not None:  # early layers' writes for later context, not now
            x = scaled_add(x, -self.backout_lambda, early)
        if self.mudd is not None:
            x = self.mudd[1](x, x0, taps[self.mudd_taps[0]], taps["L-2"], taps[self.mudd_taps[1]], *ves[:1])
        x = self.norm_f(x)
        head = self.lm_head.weight if self.lm_head is not None else self.wte.weight
        if loss_fn is not None:
            return None, loss_fn(x.view(B * T, -1), head, targets, cfg.logit_softcap)
        if cfg.logit_softcap > 0:
            # the 1/cap goes on the (V, C) weight, not the (B, T, V) logits: one pass fewer over the
            # largest tensor, which dominates eager (CPU) step time at small widths
            logits = SoftCap.apply(F.linear(x, head / cfg.logit_softcap).float(), cfg.logit_softcap)
        else:
            logits = F.linear(x, head).float()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1).long())
        return logits, loss

    def set_progress(self, frac):
        """train.py's progress in [0, 1] before each optimizer step: the tie of untie_at ends here."""
        self.tied = frac < self.config.untie_at

    def optimizer_groups(self):
        """Name -> group, where optimizers.build_optimizers's own rules would not: the gates and MUDD's mixes ("gate":
        AdamW, as medium PR #261 gives them Adam), and with untie_at the embedding ("head": the head's LR while tied and
        after, as medium #18 keeps one Adam LR for both)."""
        groups = {n: "gate" for n, _ in self.named_parameters() if n.endswith("gate.weight") or n.startswith("mudd.")}
        return groups | ({"wte.weight": "head"} if self.config.untie_at else {})

    @torch.no_grad()
    def tie_grads(self):  # AdamW's pre-step hook: while tied, one weight's gradient on the head, none on wte
        if (
            self.tied
            and self.lm_head is not None
            and self.wte.weight.grad is not None
            and self.lm_head.weight.grad is not None
        ):
            self.lm_head.weight.grad.add_(self.wte.weight.grad)
            self.wte.weight.grad = None

    @torch.no_grad()
    def sync_tied(self):  # AdamW's post-step hook; the forward never reads the tie: a checkpoint is two plain weights
        if self.tied and self.lm_head is not None:
            self.wte.weight.copy_(self.lm_head.weight)

    def compile_per_block(self):
        """torch.compile each block on its own: identical blocks share one graph (one per kind: with and without
        value embeddings), and DDP's buckets split nothing; MUDD's two mixes a graph each. The rest stays eager;
        state_dict keys stay plain."""
        for module in self.compiled_parts():
            module.compile(fullgraph=True, dynamic=False)

    def compiled_parts(self):
        return [*self.blocks, *(self.mudd if self.mudd is not None else ())]

    def num_params(self, non_embedding=False):
        """All parameters, or those outside the lookup tables (wte/wpe/value embeddings).

        A tied wte is counted as non-embedding: it is also the output matmul."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            tables = [ve.weight for ve in cast(list[nn.Embedding], self.value_embeds)] + (
                [self.bigram.weight] if self.bigram is not None else []
            )
            tables += [self.wpe.weight] if self.wpe is not None else []
            tables += [self.wte.weight] if self.lm_head is not None else []
            n -= sum(t.numel() for t in tables)
        return n

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token: 6 x matmul params (head included) + causal attention.

        Causal attention does T/2 key positions on average: 2 matmuls x 2 flops x 3 (fwd+bwd) -> 6*L*C*T."""
        cfg = self.config
        T = seq_len or cfg.seq_len
        return 6 * self.num_params(non_embedding=True) + 6 * cfg.n_layer * cfg.n_embd * T


# A checkpoint's config holds every key of the GPTConfig that wrote it; the first checkpoints' held FIRST_KEYS. Such a
# config that lacks a later switch predates it: the switch is off (SWITCHED_OFF; a switch added later that is on by
# default goes there too), as it was for those weights. Any other dict (a shape, a few switches) takes the defaults.
FIRST_KEYS = (
    "vocab_size seq_len n_layer n_head n_embd mlp_ratio norm pos rope_base qk_norm mlp_act logit_softcap value_embeds "
    "x0_mix resid_scale unet_skips zero_init_proj embed_norm tie_embeddings"
).split()
SWITCHED_OFF = {"bigram_mult": 0.0, "ve_gate": False, "backout": False, "mudd": False}  # later switches on by default


def model_config(config: dict) -> GPTConfig:
    """GPTConfig from a plain dict: unknown keys are ignored, missing keys take the defaults, except the switches a
    checkpoint written before them lacks (FIRST_KEYS): off."""
    config = dict(config or {})
    if all(k in config for k in FIRST_KEYS):
        config = {**SWITCHED_OFF, **config}
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in config.items() if k in known})


def get_model(config: dict) -> GPT:
    return GPT(model_config(config))

"""Muon for the hidden matrices, sharded across any number of ranks (optimizers.py says which matrices).

Muon = SGD momentum whose update for each 2-D weight is replaced by (approximately) the nearest
semi-orthogonal matrix, computed with a few Newton-Schulz iterations. Every direction of the update
then moves at the same rate, which is what lets short speedruns take large steps on hidden layers.
Embeddings, the output head and the 1-D gains stay on AdamW (optimizers.build_optimizers).

Distributed contract (torch.distributed with world_size > 1, NCCL or gloo):
- Gradients arrive already averaged over ranks: train.py all-reduces them once per optimizer step,
  DDP-style, before calling step(). Muon never reduces gradients itself. Every rank must therefore
  see the same parameters holding a gradient, which the assignment below is derived from.
- Every rank keeps the momentum buffer of every parameter (an elementwise update, cheap), so the
  state_dict is identical on all ranks and rank 0's checkpoint is complete.
- Only the Newton-Schulz work is sharded. Matrices are assigned to ranks deterministically,
  largest first onto the least-loaded rank (any world size; a rank without a matrix still joins the
  exchange). Each rank orthogonalises its share, same-shape matrices in one batched call, and a single
  all_gather of a padded flat buffer hands every update to every rank. All ranks apply the same
  gathered tensors, so parameters stay bit-identical. The exchange is bf16 on CUDA, float32 on CPU.
- Without an initialised process group, or with world_size == 1, it is the plain single-process
  optimizer (same code, no communication).
"""

from collections import defaultdict

import torch
import torch.distributed as dist


# Newton-Schulz coefficient sets (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X; iteration i uses entry
# min(i, len - 1), with the input divided by its Frobenius norm x safety first.
NS_COEFFS = {
    # Keller Jordan's quintic for Muon (modded-nanogpt): one fixed polynomial with a steep slope near 0.
    "quintic": ((3.4445, -4.7750, 2.0315),),
    # Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one minimax-optimal polynomial per
    # iteration, computed for 5 iterations with safety factor 2e-2 and cushion 2; the values modded-nanogpt uses.
    "polar_express": (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
}
NS_SAFETY = {"quintic": 1.0, "polar_express": 1.02}  # Polar Express's coefficients assume a spectrum in [0, 1/1.02]


def zeropower_via_newtonschulz(G: torch.Tensor, steps: int = 5, coeffs: str = "quintic") -> torch.Tensor:
    """Map G = U S V^T (last two dims; tall, wide, square or a batched stack) to about U V^T.

    coeffs names an NS_COEFFS set. "quintic" is tuned for a steep slope near zero rather than convergence, so
    after 5 steps singular values land in roughly [0.7, 1.2], not at 1, which Muon does not need; "polar_express"
    changes the polynomial at each iteration and lands closer to 1 in the same 5 steps (bench/ns_error.py).
    Computes in bf16 on CUDA and float32 on CPU (bf16 matmul is slow there); returns G's shape in the compute dtype.
    """
    table = NS_COEFFS[coeffs]
    X = (G.bfloat16() if G.is_cuda else G.float()).reshape(-1, *G.shape[-2:])  # one batch dim, for baddbmm
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide side so the Gram matrix X X^T is the small one, in Muon.step's layout
        X = X.mT.contiguous()
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * NS_SAFETY[coeffs] + 1e-7)
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)]
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A in one kernel: at small widths the
        X = torch.baddbmm(X, B, X, beta=a)  # elementwise passes cost a third of the iteration
    # row-major on every path: the exchange hands every rank flat copies, so one process must reduce NorMuon's row
    # norms over the same layout to match any world size bit for bit
    return (X.mT if tall else X).contiguous().reshape(G.shape)


def _newtonschulz_flops(shape: torch.Size) -> int:
    """Flops of one Newton-Schulz iteration on a parameter of this shape (m <= n after orienting):
    X X^T and B X cost 2 m^2 n each, A A costs 2 m^3."""
    m, n = sorted(shape[-2:])
    return shape[:-2].numel() * 2 * m * m * (2 * n + m)


def _assign_to_ranks(costs: list[float], world_size: int) -> list[int]:
    """Owner rank of each matrix: largest first onto the least-loaded rank, ties to the lower index,
    so every rank derives the same assignment from the same parameter list."""
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(world_size), key=loads.__getitem__)
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def flat_gather(distributed=dist):
    """all_gather_single is torch >= 2.13's name; older releases (the floor, 2.6) call it all_gather_into_tensor.
    None when neither exists (ranks.torch_problem refuses that torch before the clock)."""
    return getattr(distributed, "all_gather_single", None) or getattr(distributed, "all_gather_into_tensor", None)


all_gather_flat = flat_gather()


def cautious_decay_(p, direction, decay):
    """p -= decay * p where direction (the update about to be applied) and p agree in sign, in place.

    An fp32 product, a bool mask and one addcmul: 3 kernels and 26 bytes read and written an fp32 entry, where
    p.sub_(p * mask) took 4 and 38 (BENCHMARKS.md, "Per-step memory work"). sub_ rounded p - decay * p once (a fused
    multiply-add), addcmul rounds decay * p first: a decayed entry may differ by one fp32 rounding. torch's _foreach
    ops have no comparison, and a compiled kernel would be a graph that step 0 does not compile.
    """
    p.addcmul_(p, direction * p > 0, value=-decay)


def normuon_scale(update, second_moment, beta2):
    """NorMuon's factor on an orthogonalised update (Li et al. 2025, arXiv:2510.05491; modded-nanogpt's short track
    #41 and its medium track): each neuron's row (columns of a wide matrix: the longer side's entries, as the record
    chooses) divided by the root of an EMA of its mean square, then the whole matrix scaled back to the update's
    Frobenius norm, so the step's size stays Muon's and only its share between neurons moves. Updates second_moment
    (fp32, the reduced dim kept as 1) in place; returns the factor, fp32, broadcastable to update (0 for a zero update).
    """
    reduced = -1 if update.size(-2) >= update.size(-1) else -2
    row_norms = torch.linalg.vector_norm(update, dim=reduced, keepdim=True, dtype=torch.float32)
    return _normuon_factor(row_norms, second_moment, beta2, update.size(reduced))


def _normuon_factor(row_norms, second_moment, beta2, size):
    """normuon_scale from each row's norm (of `size` entries), for one matrix or a stack of them."""
    mean_square = row_norms.square() / size
    second_moment.lerp_(mean_square, 1 - beta2)
    step = second_moment.clamp_min(1e-10).rsqrt()
    norm = row_norms.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    normalised_norm = (mean_square * step.square()).sum(dim=(-2, -1), keepdim=True).mul_(size).sqrt_()
    return step * (norm / normalised_norm.clamp_min(1e-10))


class Muon(torch.optim.Optimizer):
    """Momentum + Newton-Schulz orthogonalised updates for parameters with ndim >= 2.

    The last two dims are the matrix (rows = out features); leading dims are a stack of matrices.
    Per step, for each parameter p with gradient g (already averaged over ranks):
        buf = lerp(buf, g, 1 - momentum);  u = lerp(g, buf, momentum) if nesterov else buf
        d = sqrt(max(1, rows / cols)) * NS(u)
        p -= lr * weight_decay * p * mask                            (decoupled weight decay, times the LR)
        p -= lr * d                                  (with normuon_beta2 > 0: lr * d * normuon_scale(d), NorMuon)
    with update_smoothing s > 0, NS(u) is first replaced by an EMA of it, lerp(ema, NS(u), 1 - s) ("smoothed_update",
    in NS's dtype and the parameter's layout; mnGPT medium #13-14), kept on every rank after the exchange.
    mask is 1 everywhere, or with cautious=True only where d and p have the same sign (where the update already
    pulls the weight toward 0: "cautious weight decay", modded-nanogpt's medium track). The shape factor keeps
    the per-entry update size comparable for tall matrices. Every group also
    stores "base_lr" (its lr at construction) for train.py's schedule, which rewrites "lr" and
    "momentum" in place each step.
    """

    def __init__(
        self,
        params,
        lr=0.02,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        weight_decay=0.0,
        cautious=False,
        ns_coeffs="quintic",
        normuon_beta2=0.0,
        update_smoothing=0.0,
    ):
        if ns_coeffs not in NS_COEFFS:
            raise ValueError(f"ns_coeffs must be one of {', '.join(NS_COEFFS)}, got {ns_coeffs!r}")
        if not 0.0 <= normuon_beta2 < 1.0:
            raise ValueError(f"normuon_beta2 must be in [0, 1) (0: off), got {normuon_beta2}")
        if not 0.0 <= update_smoothing < 1.0:
            raise ValueError(f"update_smoothing must be in [0, 1) (0: off), got {update_smoothing}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            cautious=cautious,
            ns_coeffs=ns_coeffs,
            normuon_beta2=normuon_beta2,
            update_smoothing=update_smoothing,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if any(p.ndim < 2 for p in group["params"]):
            raise ValueError("Muon only takes parameters with ndim >= 2; give gains, scalars and biases to AdamW")
        group.setdefault("base_lr", group["lr"])

    @torch.no_grad()
    def step(self, closure=None):
        """One step, its elementwise work grouped: a few foreach kernels over every matrix, and Newton-Schulz and
        NorMuon on one stack per oriented shape (a tall matrix joins the wide ones of its transposed shape), so the
        host dispatches ~100 ops a step however many matrices there are (BENCHMARKS.md, "The host's share")."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(p, gi) for gi, group in enumerate(self.param_groups) for p in group["params"] if p.grad is not None]
        if not work:
            return loss
        params = [p for p, _ in work]
        for gi, group in enumerate(self.param_groups):
            mine = [p for p, g in work if g == gi]
            if mine:
                bufs = [self._momentum_buffer(p) for p in mine]
                torch._foreach_lerp_(bufs, [p.grad for p in mine], 1 - group["momentum"])

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        owners = _assign_to_ranks([_newtonschulz_flops(p.shape) for p in params], world_size)
        batches = stacked_batches(work)
        stacks = self._orthogonalised(params, batches, owners, rank)
        if distributed:
            stacks = self._exchange(params, batches, owners, stacks, world_size, rank)

        updates: dict[int, torch.Tensor] = {}  # matrix -> its update
        decays: dict[int, list[int]] = {}  # param group -> its matrices
        for key, idx in batches.items():
            group = self.param_groups[key[0]]
            if group.get("update_smoothing", 0.0):
                stacks[key] = self._smoothed(params, idx, group["update_smoothing"], stacks[key])
            for i, update in zip(idx, self._scaled_updates(params, idx, group, stacks[key])):
                updates[i] = update
            decays.setdefault(key[0], []).extend(idx)
        for gi, idx in decays.items():
            group = self.param_groups[gi]
            mine, mine_updates = [params[i] for i in idx], [updates[i] for i in idx]
            decay = group["lr"] * group["weight_decay"]
            if decay and group.get("cautious", False):
                cautious_decay_all_(mine, mine_updates, decay)
            elif decay:
                torch._foreach_mul_(mine, 1 - decay)
            torch._foreach_add_(mine, mine_updates)
        return loss

    def _momentum_buffer(self, p):
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        return state["momentum_buffer"]

    def _orthogonalised(self, params, batches, owners, rank):
        """{batch key: Newton-Schulz of this rank's share of the batch, stacked in batch order}: the directions
        (Nesterov's look-ahead: one foreach lerp per group) oriented wide, as stacked_batches orders them."""
        stacks = {}
        for key, idx in batches.items():
            mine = [i for i in idx if owners[i] == rank]
            if not mine:
                continue
            group = self.param_groups[key[0]]
            grads = [params[i].grad for i in mine]
            bufs = [self.state[params[i]]["momentum_buffer"] for i in mine]
            directions = torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"] else bufs
            oriented = torch.stack([d.mT if is_tall(d) else d for d in directions])
            stacks[key] = zeropower_via_newtonschulz(oriented, group["ns_steps"], group["ns_coeffs"])
        return stacks

    def _scaled_updates(self, params, idx, group, stack):
        """Each matrix's update, -lr x the shape factor (x NorMuon's, if on) x its orthogonalised direction, in the
        parameter's own layout (fp32, contiguous: what a foreach kernel takes without falling back to a loop)."""
        tall = sum(is_tall(params[i]) for i in idx)  # stacked_batches puts them first
        if group.get("normuon_beta2", 0.0):
            coef = self._normuon_batch(params, idx, group["normuon_beta2"], stack).mul_(-group["lr"])
        else:
            coef = torch.full((len(idx),) + (1,) * (stack.ndim - 1), -group["lr"], device=stack.device)
        if tall:
            p = params[idx[0]]
            scale = (p.size(-2) / p.size(-1)) ** 0.5  # sqrt(rows / cols): Muon's scale for tall matrices
            if group.get("normuon_beta2", 0.0):
                coef[:tall].mul_(scale)
            else:  # rounded once, as add(update, alpha=-lr * scale) rounds it
                coef[:tall].fill_(-group["lr"] * scale)
        update = stack * coef
        return [*update[:tall].mT.contiguous().unbind(), *update[tall:].unbind()]

    def _normuon_batch(self, params, idx, beta2, stack):
        """normuon_scale over a batch's oriented stack, one kernel an op: each neuron's row (a column of the oriented
        stack, but a square matrix's own rows) normalised by its second moment, kept fp32 in the parameter's own
        layout as normuon_scale keeps it. On every rank after the exchange, so every rank keeps every moment."""
        reduced = -1 if stack.size(-2) == stack.size(-1) else -2
        moments = []
        for i in idx:
            state, p = self.state[params[i]], params[i]
            if "second_moment" not in state:
                kept = -1 if p.size(-2) >= p.size(-1) else -2
                shape = (*p.shape[:-1], 1) if kept == -1 else (*p.shape[:-2], 1, p.size(-1))
                state["second_moment"] = p.new_zeros(shape, dtype=torch.float32)
            moment = state["second_moment"]
            moments.append(moment.mT if is_tall(p) else moment)
        stacked = torch.stack(moments)
        row_norms = torch.linalg.vector_norm(stack, dim=reduced, keepdim=True, dtype=torch.float32)
        factor = _normuon_factor(row_norms, stacked, beta2, stack.size(reduced))
        torch._foreach_copy_(moments, list(stacked.unbind()))
        return factor

    def _smoothed(self, params, idx, smoothing, stack):
        """The EMA of a batch's orthogonalised stack: each matrix's "smoothed_update", in its own layout (a tall one's
        viewed oriented) and Newton-Schulz's dtype (bf16 on CUDA, as the record keeps it), lerped in place by one
        foreach kernel, then stacked for what follows."""
        emas = []
        for i in idx:
            state, p = self.state[params[i]], params[i]
            if "smoothed_update" not in state:
                state["smoothed_update"] = torch.zeros_like(p, dtype=stack.dtype)
            emas.append(state["smoothed_update"].mT if is_tall(p) else state["smoothed_update"])
        torch._foreach_lerp_(emas, list(stack.unbind()), 1.0 - smoothing)
        return torch.stack(emas)

    @staticmethod
    def _exchange(params, batches, owners, stacks, world_size, rank):
        """all_gather every rank's orthogonalised share; returns {batch key: every matrix's update, stacked in batch
        order}, the same tensor one process computes.

        Each rank packs its share, in parameter order, into a flat buffer padded to the largest share,
        so one equal-size collective (supported by NCCL and gloo) moves everything.
        """
        device = params[0].device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # = Newton-Schulz's compute dtype
        where = {i: (key, j) for key, idx in batches.items() for j, i in enumerate(i for i in idx if owners[i] == rank)}
        shares = [[i for i in range(len(params)) if owners[i] == r] for r in range(world_size)]
        sizes = [[params[i].numel() for i in share] for share in shares]
        width = max(sum(s) for s in sizes)
        send = torch.zeros(width, dtype=dtype, device=device)
        if shares[rank]:
            mine = [stacks[where[i][0]][where[i][1]].flatten() for i in shares[rank]]
            send[: sum(sizes[rank])] = torch.cat(mine)
        gathered = torch.empty(world_size * width, dtype=dtype, device=device)
        all_gather_flat(gathered, send)  # flat output: gloo rejects the stacked (world, width) form
        gathered = gathered.view(world_size, width)
        flat: dict[int, torch.Tensor] = {}
        for r, share in enumerate(shares):
            flat.update(zip(share, gathered[r, : sum(sizes[r])].split(sizes[r])))
        stacked = {}
        for key, idx in batches.items():
            stacked[key] = torch.stack([flat[i].view(oriented_shape(params[i])) for i in idx])
        return stacked


def is_tall(t):
    return t.size(-2) > t.size(-1)


def oriented_shape(t):
    """t's shape with its last two dims wide (rows <= cols): the layout Newton-Schulz iterates on."""
    return (*t.shape[:-2], t.size(-1), t.size(-2)) if is_tall(t) else tuple(t.shape)


def stacked_batches(work):
    """{(group index, oriented shape): indices into work}: the matrices Muon stacks into one Newton-Schulz call and
    one NorMuon pass, tall ones first (their updates go back to their own layout in one copy), then in order."""
    batches = defaultdict(list)
    for i, (p, gi) in sorted(enumerate(work), key=lambda item: (not is_tall(item[1][0]), item[0])):
        batches[(gi, oriented_shape(p))].append(i)
    return dict(batches)


def cautious_decay_all_(params, updates, decay):
    """cautious_decay_ for lists, four foreach kernels however many matrices: p -= decay * p where the update about
    to be added (a negative multiple of the direction) and p disagree in sign, i.e. where the direction and p agree.
    min(update * p, 0) has the sign of -[agree]; p + decay * p * sign(that) is p - decay * p there, p elsewhere, with
    the same single rounding as cautious_decay_."""
    agree = torch._foreach_mul(updates, params)
    torch._foreach_clamp_max_(agree, 0.0)
    torch._foreach_sign_(agree)
    torch._foreach_addcmul_(params, params, agree, value=decay)

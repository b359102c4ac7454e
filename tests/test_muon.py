"""Tests for muon.py: Newton-Schulz, the Muon step, sharding over gloo ranks, resume, the split rule."""

import io
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import muon  # noqa: E402
import optimizers  # noqa: E402
from conftest import free_port, init_gloo  # noqa: E402
from muon import Muon, _assign_to_ranks, _newtonschulz_flops, zeropower_via_newtonschulz  # noqa: E402
from optimizers import Snoo, build_optimizers  # noqa: E402

torch.set_num_threads(1)  # CI has 2 cores and the gloo tests run several processes

# The quintic's coefficients trade convergence for speed: 5 steps leave each singular value oscillating
# in roughly [0.68, 1.2] (the map a*x + b*x^3 + c*x^5 is not a contraction onto 1). Band = that + margin.
BAND = (0.65, 1.25)


def spectrum_matrix(shape, condition, generator):
    """Random singular vectors, singular values log-spaced over [1/condition, 1]."""
    *batch, m, n = shape
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(*batch, m, k, generator=generator))[0]
    V = torch.linalg.qr(torch.randn(*batch, n, k, generator=generator))[0]
    s = torch.logspace(0, -math.log10(condition), k)[torch.randperm(k, generator=generator)]
    return U @ torch.diag_embed(s.expand(*batch, k)) @ V.mT


def ns_inputs():
    g = torch.Generator().manual_seed(0)
    # Rectangular Gaussian matrices are well conditioned. Square Gaussian ones have singular values near 0
    # that 5 steps cannot lift (nor need to), so squares get a spectrum with condition number 100.
    yield torch.randn(32, 128, generator=g)
    yield torch.randn(128, 32, generator=g)
    yield torch.randn(4, 48, 24, generator=g) * 50
    yield spectrum_matrix((64, 64), 100, g)
    yield spectrum_matrix((3, 40, 40), 100, g) * 1e-3


@pytest.mark.parametrize("coeffs", ["quintic", "polar_express"])
@pytest.mark.parametrize("G", list(ns_inputs()), ids=lambda G: "x".join(map(str, G.shape)))
def test_newtonschulz_singular_values_in_band_with_same_singular_vectors(G, coeffs):
    ortho = zeropower_via_newtonschulz(G, steps=5, coeffs=coeffs)
    assert ortho.shape == G.shape and ortho.dtype == torch.float32
    s = torch.linalg.svdvals(ortho)
    assert BAND[0] <= s.min().item() and s.max().item() <= BAND[1], (s.min().item(), s.max().item())
    # ortho = U f(S) V^T shares G's singular vectors: G^T ortho = V S f(S) V^T (or G ortho^T = U S f(S) U^T for wide G)
    # is symmetric positive semi-definite. A wrong transpose or a scrambled basis breaks this.
    GtO = G.mT @ ortho if G.size(-2) >= G.size(-1) else G @ ortho.mT
    torch.testing.assert_close(GtO, GtO.mT, rtol=1e-3, atol=1e-3 * GtO.abs().max().item())
    assert torch.linalg.eigvalsh(0.5 * (GtO + GtO.mT)).min() > -1e-3 * GtO.abs().max()


def test_polar_express_lands_closer_to_the_polar_factor_than_the_quintic():
    """Per-iteration minimax polynomials: after 5 iterations on a well-conditioned matrix the singular values sit
    near 1 (the quintic's oscillate in [0.7, 1.2]); bench/ns_error.py measures this on real gradients."""
    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    error = {c: (zeropower_via_newtonschulz(G, 5, c) - U @ Vh).norm().item() for c in muon.NS_COEFFS}
    assert error["polar_express"] < 0.5 * error["quintic"], error
    s = torch.linalg.svdvals(zeropower_via_newtonschulz(G, 5, "polar_express"))
    assert 0.85 < s.min().item() and s.max().item() < 1.15, (s.min().item(), s.max().item())
    with pytest.raises(ValueError, match="ns_coeffs"):
        Muon([nn.Parameter(torch.ones(2, 2))], ns_coeffs="cubic")


def test_newtonschulz_batch_matches_one_by_one():
    G = torch.randn(5, 16, 40, generator=torch.Generator().manual_seed(1))
    batched = zeropower_via_newtonschulz(G)
    for g, o in zip(G, batched):
        torch.testing.assert_close(zeropower_via_newtonschulz(g), o)


def make_params(n_matrices, seed=0):
    """Mixed shapes: tall, wide, square, repeats (batched together) and a stack of matrices."""
    shapes = [(24, 16), (16, 24), (24, 16), (16, 16), (3, 8, 12), (40, 8), (16, 24)][:n_matrices]
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in shapes]


def make_muon(params, normuon_beta2=0.0, update_smoothing=0.0):
    half = (len(params) + 1) // 2
    groups = [dict(params=params[:half]), dict(params=params[half:], lr=0.05, weight_decay=0.1, nesterov=False)]
    groups = [g for g in groups if g["params"]]
    return Muon(
        groups, lr=0.02, momentum=0.9, weight_decay=0.01, normuon_beta2=normuon_beta2, update_smoothing=update_smoothing
    )


class Stepped(list):
    """Muon, with Snoo stepped after it (every 2nd step: it fires at steps 1, 3 and 5 of 5) when asked."""

    def __init__(self, params, normuon_beta2=0.0, update_smoothing=0.0, snoo=False):
        super().__init__([make_muon(params, normuon_beta2, update_smoothing)])
        if snoo:
            self.append(Snoo(params, lr=0.68, momentum=0.37, every=2))

    def step(self):
        for opt in self:
            opt.step()


def set_grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def run_steps(params, opt, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        set_grads(params, step)
        opt.step()


def reference_snapshots(n_matrices, options):
    """Single-process parameters after 1 and after 5 steps."""
    params = make_params(n_matrices)
    opt = Stepped(params, **options)
    run_steps(params, opt, 1)
    after_1 = [p.detach().clone() for p in params]
    run_steps(params, opt, 4, first_step=1)
    return after_1, [p.detach().clone() for p in params]


def gloo_worker(rank, world_size, port, options, cases):
    init_gloo(rank, world_size, port)
    try:
        orthogonalised = []  # how many parameters this rank ran Newton-Schulz on

        def counting_newtonschulz(G, steps, coeffs="quintic"):
            orthogonalised.append(len(G))  # Muon stacks whole parameters along a new first dim
            return zeropower_via_newtonschulz(G, steps, coeffs)

        muon.zeropower_via_newtonschulz = counting_newtonschulz  # a spawned process: patches only itself
        for n_matrices, (after_1, after_5) in cases:
            orthogonalised.clear()
            params = make_params(n_matrices)
            opt = Stepped(params, **options)
            run_steps(params, opt, 1)
            for p, expected in zip(params, after_1):
                assert torch.equal(p.detach(), expected)
            run_steps(params, opt, 4, first_step=1)
            for p, expected in zip(params, after_5):
                assert torch.equal(p.detach(), expected)
            # Sharded, not replicated: over all ranks, each parameter went through Newton-Schulz once a step.
            work = torch.tensor([sum(orthogonalised)])
            dist.all_reduce(work)
            assert work.item() == 5 * n_matrices
            # Parameters and optimizer state (Snoo's too) bit-identical on every rank
            state = [v for o in opt for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
            for t in [p.detach() for p in params] + state:
                everyone = [torch.empty_like(t) for _ in range(world_size)]
                dist.all_gather(everyone, t.contiguous())
                assert all(torch.equal(everyone[0], other) for other in everyone[1:])
            # The state_dict is complete on every rank: a momentum buffer (and NorMuon's second moment, the smoothed
            # update) for every parameter.
            optional = {"second_moment": "normuon_beta2", "smoothed_update": "update_smoothing"}
            kinds = {"momentum_buffer"} | {kind for kind, option in optional.items() if options.get(option)}
            state = opt[0].state_dict()["state"]
            assert len(state) == n_matrices and all(set(v) == kinds for v in state.values())
    finally:
        dist.destroy_process_group()
    # torch 2.13 + gloo: interpreter teardown after destroy_process_group sometimes aborts ("terminate called
    # without an active exception", ~10% of 2-rank runs); once every check has passed, skip the teardown.
    os._exit(0)


SMOOTHED_SNOO = dict(normuon_beta2=0.95, update_smoothing=0.2, snoo=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size, options",
    [(2, {}), (3, {}), (2, dict(normuon_beta2=0.95)), (2, SMOOTHED_SNOO), (3, SMOOTHED_SNOO)],
    ids=["2", "3", "2-normuon", "2-smoothed-snoo", "3-smoothed-snoo"],
)
def test_sharded_steps_match_single_process_and_agree_across_ranks(world_size, options):
    """Muon, NorMuon and the smoothing (after the exchange, on every rank), Snoo (elementwise after it): the same
    steps as one process, bit for bit."""
    # 7 matrices: more matrices than ranks; world_size - 1 matrices: a rank owns nothing.
    cases = [(n, reference_snapshots(n, options)) for n in (7, world_size - 1)]
    mp.spawn(gloo_worker, args=(world_size, free_port(), options, cases), nprocs=world_size)


def test_assignment_is_balanced_for_any_world_size():
    # The default model's hidden matrices: 48 attention 768x768 and 24 MLP 768x3072 / 3072x768.
    costs = [_newtonschulz_flops(torch.Size(s)) for s in [(768, 768)] * 48 + [(3072, 768), (768, 3072)] * 12]
    assert costs[-1] == 3 * costs[0]  # m^2 (2n + m): an MLP matrix is three attention matrices
    for world_size in (1, 2, 3, 8, 32, 100):
        owners = _assign_to_ranks(costs, world_size)
        loads = [sum(c for c, r in zip(costs, owners) if r == rank) for rank in range(world_size)]
        assert set(owners) <= set(range(world_size)) and len(owners) == len(costs)
        # Greedy largest-first is within one largest item of the ideal share.
        assert max(loads) <= sum(costs) / world_size + max(costs)
    assert _assign_to_ranks([3.0, 1.0], 5) == [0, 1]


@pytest.mark.parametrize("shape", [(32, 8), (8, 32), (2, 12, 12)])
def test_first_step_is_scaled_orthogonalised_gradient_with_decoupled_decay(shape):
    p = nn.Parameter(torch.randn(*shape))
    p0 = p.detach().clone()
    opt = Muon([p], lr=1.0, momentum=0.5, nesterov=False, weight_decay=0.5)
    # train.py rewrites lr and momentum every step; base_lr keeps the construction value.
    opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"] = 0.1, 0.9
    p.grad = torch.randn(*shape)
    opt.step()
    scale = math.sqrt(max(1.0, shape[-2] / shape[-1]))
    expected = p0 * (1 - 0.1 * 0.5) - 0.1 * scale * zeropower_via_newtonschulz(0.1 * p.grad)
    torch.testing.assert_close(p.detach(), expected)
    assert opt.param_groups[0]["base_lr"] == 1.0


def test_cautious_decay_only_where_the_update_and_the_weight_agree_in_sign():
    g = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.randn(16, 8, generator=g))
    p0 = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False, weight_decay=1.2, cautious=True)
    p.grad = torch.randn(16, 8, generator=g)
    opt.step()
    update = zeropower_via_newtonschulz(p.grad)  # momentum 0: the gradient itself
    mask = (update * p0 > 0).float()
    assert 0.2 < mask.mean().item() < 0.8  # both kinds of entries are present
    expected = p0 - 0.1 * 1.2 * mask * p0 - 0.1 * math.sqrt(16 / 8) * update
    torch.testing.assert_close(p.detach(), expected)


def test_cautious_adamw_decays_only_where_its_update_and_the_weight_agree_in_sign():
    g = torch.Generator().manual_seed(4)
    w0, grad = torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g)
    plain, cautious = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opts = [
        torch.optim.AdamW([plain], lr=0.1, weight_decay=0.0),
        optimizers.CautiousAdamW([dict(params=[cautious], cautious_wd=0.5)], lr=0.1, weight_decay=0.0, fused=True),
    ]
    for p, opt in zip((plain, cautious), opts):
        p.grad = grad.clone()
        opt.step()
    mask = (opts[1].state[cautious]["exp_avg"] * plain.detach() > 0).float()
    assert 0.2 < mask.mean().item() < 0.8
    torch.testing.assert_close(cautious.detach(), plain.detach() * (1 - 0.1 * 0.5 * mask))


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="ndim >= 2"):
        Muon([nn.Parameter(torch.ones(4))])


def test_state_dict_round_trip_resumes_to_the_same_next_step():
    params = make_params(7)
    opt = make_muon(params)
    run_steps(params, opt, 3)
    saved_params = [p.detach().clone() for p in params]
    checkpoint = io.BytesIO()
    torch.save(opt.state_dict(), checkpoint)
    run_steps(params, opt, 1, first_step=3)

    resumed = [nn.Parameter(t.clone()) for t in saved_params]
    resumed_opt = make_muon(resumed)
    for group in resumed_opt.param_groups:  # stale values, overwritten by the load
        group["lr"], group["momentum"], group["base_lr"] = 0.5, 0.1, 0.5
    checkpoint.seek(0)
    resumed_opt.load_state_dict(torch.load(checkpoint))
    assert [g["base_lr"] for g in resumed_opt.param_groups] == [0.02, 0.05]
    run_steps(resumed, resumed_opt, 1, first_step=3)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed))

    # Without the momentum state the next step differs, so the check above has teeth.
    fresh = [nn.Parameter(t.clone()) for t in saved_params]
    run_steps(fresh, make_muon(fresh), 1, first_step=3)
    assert not torch.allclose(fresh[0], params[0])


VOCAB, CONTEXT = 32, 2


class TinyNextToken(nn.Module):
    """Embed the last two tokens, a 3-layer MLP, an untied head."""

    def __init__(self, dim=32, hidden=128):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.fc1 = nn.Linear(CONTEXT * dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, context):
        x = self.wte(context).flatten(1)
        return self.lm_head(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))))


def markov_batches(steps, batch_size, seed):
    """A random second-order Markov chain over VOCAB tokens (peaked rows, entropy about 1.46 nats)."""
    table = torch.softmax(3 * torch.randn(VOCAB**CONTEXT, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        context = torch.randint(0, VOCAB, (batch_size, CONTEXT), generator=g)
        targets = torch.multinomial(table[context[:, 0] * VOCAB + context[:, 1]], 1, generator=g).squeeze(1)
        yield context, targets


def train_tiny(make_optimizers, steps=200):
    torch.manual_seed(0)
    model = TinyNextToken()
    optimizers = make_optimizers(model)
    for context, targets in markov_batches(steps, 256, seed=1):
        loss = F.cross_entropy(model(context), targets)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
    context, targets = next(markov_batches(1, 4096, seed=2))
    with torch.no_grad():
        return F.cross_entropy(model(context), targets).item()


@pytest.mark.slow
def test_muon_plus_adamw_beats_tuned_adamw_in_the_same_steps():
    adam = dict(betas=(0.9, 0.95), eps=1e-8)
    # AdamW alone gets its best of three learning rates (1e-2 is best; 5e-3 and 2e-2 bracket it).
    adamw_losses = {
        lr: train_tiny(lambda m: [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0, **adam)])
        for lr in (5e-3, 1e-2, 2e-2)
    }
    muon_loss = train_tiny(
        lambda m: build_optimizers(
            m,
            muon_lr=0.02,
            embed_lr=1e-2,
            head_lr=1e-2,
            scalar_lr=1e-2,
            muon_momentum=0.95,
            adam_betas=adam["betas"],
            adam_eps=adam["eps"],
        )
    )
    print(f"held-out loss after 200 steps: Muon+AdamW {muon_loss:.3f}, AdamW {adamw_losses} (uniform 3.466)")
    # Measured: Muon+AdamW 2.22, best AdamW 2.41 (seeds 1 and 2 give the same gap).
    assert muon_loss < min(adamw_losses.values()) - 0.1


class SplitNet(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Parameter(torch.zeros(()))
        self.stack = nn.Parameter(torch.randn(3, 8, 8))
        self.frozen = nn.Parameter(torch.randn(8, 8), requires_grad=False)
        self.lm_head = nn.Linear(8, 10, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


def test_build_optimizers_split_rule():
    model = SplitNet()
    muon, adamw = build_optimizers(
        model,
        muon_lr=0.02,
        embed_lr=0.6,
        head_lr=0.008,
        scalar_lr=0.04,
        muon_momentum=0.9,
        adam_betas=(0.8, 0.95),
        adam_eps=1e-10,
        muon_weight_decay=1.2,
        adam_weight_decay=0.005,
        ns_coeffs="polar_express",
    )
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    groups = {g["name"]: g for opt in (muon, adamw) for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    members = {name: sorted(names[id(p)] for p in g["params"]) for name, g in groups.items()}
    assert members == {
        "muon": ["fc.weight", "proj.weight", "stack"],
        "embed": ["wte.weight"],
        "head": ["lm_head.weight"],
        "scalar": ["fc.bias", "gate", "norm.bias", "norm.weight"],
    }
    expected = {"muon": (0.02, 1.2), "embed": (0.6, 0.005), "head": (0.008, 0.005), "scalar": (0.04, 0.0)}
    decay = {n: g["weight_decay"] if n == "muon" else g["cautious_wd"] for n, g in groups.items()}
    assert {n: (g["lr"], decay[n]) for n, g in groups.items()} == expected
    assert groups["muon"]["cautious"] and groups["muon"]["ns_coeffs"] == "polar_express"
    assert all(g["weight_decay"] == 0.0 for g in adamw.param_groups)  # torch's plain decay stays off
    assert all(g["base_lr"] == g["lr"] for g in groups.values())
    assert groups["muon"]["momentum"] == 0.9
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-10 for g in adamw.param_groups)
    assert adamw.defaults["fused"]  # one kernel over all tensors, on CPU too


def test_build_optimizers_tied_head_counts_once_and_empty_groups_are_left_out():
    model = SplitNet(tied=True)
    muon, adamw = build_optimizers(model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    assert [g["name"] for g in adamw.param_groups] == ["embed", "scalar"]
    assert [len(g["params"]) for g in adamw.param_groups] == [1, 4]
    assert adamw.param_groups[0]["params"][0] is model.wte.weight
    assert len(muon.param_groups[0]["params"]) == 3


def test_build_optimizers_tied_head_takes_the_head_lr_when_named():
    model = SplitNet(tied=True)
    _, adamw = build_optimizers(
        model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04, tied_head=model.wte.weight
    )
    groups = {g["name"]: g for g in adamw.param_groups}
    assert set(groups) == {"head", "scalar"}
    assert groups["head"]["params"] == [model.wte.weight] and groups["head"]["lr"] == 0.008


def test_build_optimizers_adamw_only_puts_hidden_matrices_in_their_own_group():
    model = SplitNet()
    optimizers = build_optimizers(
        model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04, use_muon=False, hidden_adamw_lr=3e-3
    )
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.AdamW)
    groups = {g["name"]: g for g in optimizers[0].param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in groups["hidden"]["params"]) == ["fc.weight", "proj.weight", "stack"]
    assert groups["hidden"]["lr"] == groups["hidden"]["base_lr"] == 3e-3

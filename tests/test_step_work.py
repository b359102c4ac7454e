"""The cautious weight decay in fewer passes (muon.cautious_decay_) and the embedding tables' sparse gradients after a
step's first micro-step (model.lookup): the bytes they move, and that results equal the plain formula's (the "old
formula" below: p minus decay x p where the update and p agree in sign, one kernel per operation)."""

import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import muon
from conftest import free_port, init_gloo
import model as model_module
from model import get_model
from muon import Muon
from optimizers import CautiousAdamW

torch.set_num_threads(1)  # CI has 2 cores and the gloo tests run several processes

EPS = torch.finfo(torch.float32).eps


def old_cautious_decay_(p, direction, decay):
    """The decay as the plain formula: the reference the fused one must match."""
    p.sub_(p * (direction * p > 0), alpha=decay)


def old_cautious_decay_all_(params, updates, decay):
    """Muon's decay one matrix at a time in the old formula; an update is a negative multiple of its direction."""
    for p, update in zip(params, updates):
        old_cautious_decay_(p, -update, decay)


class BytesMoved(TorchDispatchMode):
    """Kernels run and bytes they read and write: each distinct tensor argument read once, each output written once
    (views move nothing). The memory-traffic model of bench/step_work.py's arithmetic."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            reads = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            specs = func._schema.arguments
            mutated = [a for a, spec in zip(args, specs) if spec.alias_info and spec.alias_info.is_write]
            writes = {id(t): t for t in tree_leaves((out, mutated)) if isinstance(t, torch.Tensor)}
            self.kernels += 1
            self.bytes += sum(t.numel() * t.element_size() for t in [*reads.values(), *writes.values()])
        return out


def with_zeros(t, generator, fraction=0.1):
    """t with a fraction of its entries set to +0 and as many to -0: the sign tests' edge cases."""
    t = t.clone()
    draw = torch.rand(t.shape, generator=generator)
    t[draw < fraction] = 0.0
    t[draw > 1 - fraction] = -0.0
    return t


def muon_params(seed=0):
    """Tall, wide and stacked matrices with exact zeros; the last one's gradient is all zeros (a zero update)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (16, 24), (2, 8, 12), (12, 12)]
    params = [nn.Parameter(with_zeros(torch.randn(s, generator=g) * 0.1, g)) for s in shapes]
    return params, g


def set_grads(params, g):
    for p in params[:-1]:
        p.grad = with_zeros(torch.randn(p.shape, generator=g), g)
    params[-1].grad = torch.zeros_like(params[-1])


def run_muon(params, g, steps):
    opt = Muon(params, lr=0.05, momentum=0.9, weight_decay=1.2, cautious=True, ns_coeffs="polar_express")
    for _ in range(steps):
        set_grads(params, g)
        opt.step()
    return opt


def decay_cost(make_optimizer, decayed, n_params=1, **decay):
    """(kernels, bytes) that decay adds to one step of make_optimizer's optimizer over n_params 64 x 32 weights,
    against the same step without it."""
    counts = []
    for weight_decay in (decay, {k: 0.0 for k in decay}):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 32, generator=g)) for _ in range(n_params)]
        for p in params:
            p.grad = torch.randn(64, 32, generator=g)
        opt = make_optimizer(params, **weight_decay)
        opt.step()  # state exists: the counted step runs no first-step initialisation
        with BytesMoved() as moved:
            opt.step()
        counts.append((moved.kernels, moved.bytes))
    return counts[0][0] - counts[1][0], (counts[0][1] - counts[1][1]) / decayed


def test_adamws_cautious_decay_runs_3_kernels_and_moves_26_bytes_an_entry():
    """The plain formula runs 4 kernels and moves 38 bytes an fp32 entry (the sum of each kernel's reads and
    writes): fp32 product and mask, then p * mask, then p.sub_. Its few large tables keep the per-tensor form: bytes,
    not launches."""
    kernels, per_entry = decay_cost(
        lambda ps, cautious_wd: CautiousAdamW([dict(params=ps, cautious_wd=cautious_wd)], lr=0.1, fused=True),
        64 * 32,
        cautious_wd=0.5,
    )
    assert (kernels, per_entry) == (3, 26.0)


@pytest.mark.parametrize("n_params", [1, 6])
def test_muons_cautious_decay_is_4_foreach_kernels_however_many_matrices(n_params):
    """Muon's ~100 matrices: four kernels in all (product, clamp, sign, addcmul), 40 bytes an fp32 entry, where one
    matrix at a time took 3 kernels each (26 bytes an entry) and the host dispatched ~300 of them."""
    kernels, per_entry = decay_cost(
        lambda ps, weight_decay: Muon(ps, lr=0.05, weight_decay=weight_decay, cautious=True),
        n_params * 64 * 32,
        n_params,
        weight_decay=1.2,
    )
    assert (kernels, per_entry) == (4, 40.0)


@pytest.mark.parametrize("direction_dtype", [torch.float32, torch.bfloat16])
def test_cautious_decay_equals_the_old_formula_within_one_rounding(direction_dtype):
    g = torch.Generator().manual_seed(1)
    p0 = with_zeros(torch.randn(256, 64, generator=g), g)
    direction = with_zeros(torch.randn(256, 64, generator=g), g).to(direction_dtype)  # Muon's bf16 update on CUDA
    old, new = p0.clone(), p0.clone()
    old_cautious_decay_(old, direction, 0.03)
    muon.cautious_decay_(new, direction, 0.03)
    agree = direction.float() * p0 > 0
    assert 0.3 < agree.float().mean() < 0.5  # both kinds of entries, and zeros in each operand
    assert torch.equal(new[~agree], p0[~agree])  # where they disagree in sign, or either is 0: untouched
    # decayed entries: p - 0.03 p rounded once (old, a fused multiply-add) or twice (new): within one rounding
    assert ((new - old).abs() <= EPS * old.abs()).all()
    assert not torch.equal(new, p0)


def test_cautious_muon_step_equals_the_old_formula_within_one_rounding(monkeypatch):
    params, g = muon_params()
    p0 = [p.detach().clone() for p in params]
    run_muon(params, g, 1)
    new = [p.detach().clone() for p in params]

    monkeypatch.setattr(muon, "cautious_decay_all_", old_cautious_decay_all_)
    params, g = muon_params()
    run_muon(params, g, 1)
    for before, after, reference in zip(p0, new, params):
        assert ((after - reference).abs() <= 2 * EPS * before.abs().max()).all()
    assert torch.equal(new[-1], p0[-1])  # a zero gradient: a zero update, so no decay either


def test_cautious_adamw_step_equals_the_old_formula_within_one_rounding(monkeypatch):
    def run():
        g = torch.Generator().manual_seed(2)
        table = nn.Parameter(with_zeros(torch.randn(64, 16, generator=g), g))
        opt = CautiousAdamW([dict(params=[table], cautious_wd=0.5)], lr=0.1, betas=(0.8, 0.95), fused=True)
        for _ in range(3):
            grad = torch.randn(64, 16, generator=g)
            grad[:8] = 0.0  # rows no token hit: exp_avg stays 0 there, so they are never decayed
            table.grad = grad
            opt.step()
        return table.detach()

    new = run()
    monkeypatch.setattr(muon, "cautious_decay_", old_cautious_decay_)
    old = run()
    assert ((new - old).abs() <= 4 * EPS * old.abs().max()).all()
    assert torch.equal(new[:8], old[:8])


def sharded_muon_worker(rank, world_size, port, after_1_old, after_3_new):
    init_gloo(rank, world_size, port)
    try:
        params, g = muon_params()
        opt = run_muon(params, g, 1)
        for p, reference in zip(params, after_1_old):
            assert ((p.detach() - reference).abs() <= 2 * EPS * reference.abs().max()).all()
        for _ in range(2):
            set_grads(params, g)
            opt.step()
        assert all(torch.equal(p.detach(), reference) for p, reference in zip(params, after_3_new))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # torch 2.13 + gloo: interpreter teardown after destroy_process_group sometimes aborts


@pytest.mark.slow
def test_sharded_cautious_muon_equals_single_process_and_the_old_formula(monkeypatch):
    """2 gloo ranks: after one step within one rounding of the old formula's single-process result, after three
    bitwise the new single-process result (the same kernels run on every rank's gathered update)."""
    params, g = muon_params()
    run_muon(params, g, 3)
    after_3_new = [p.detach().clone() for p in params]
    monkeypatch.setattr(muon, "cautious_decay_all_", old_cautious_decay_all_)
    params, g = muon_params()
    run_muon(params, g, 1)
    after_1_old = [p.detach().clone() for p in params]
    mp.spawn(sharded_muon_worker, args=(2, free_port(), after_1_old, after_3_new), nprocs=2)


TABLES = ("wte.weight", "bigram.weight", "value_embeds.0.weight")
SMALL = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=16, bigram_mult=2.0, zero_init_proj=False)


def micro_batches(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(count)
    ]


def record_layouts(model):
    """The layout of each gradient autograd hands each table, in order."""
    layouts = {name: [] for name in TABLES}
    params = dict(model.named_parameters())
    for name in TABLES:
        params[name].register_hook(lambda grad, name=name: layouts[name].append(grad.layout))
    return layouts


def dense_sum(model, batches):
    """Each micro-step's gradients taken alone (every table's dense), summed: the reference."""
    total = {}
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad
    model.zero_grad(set_to_none=True)
    return total


@pytest.mark.parametrize("form", ["summed", "looked_up"])
@pytest.mark.parametrize("tied", [False, True])
def test_later_micro_steps_hand_the_tables_sparse_gradients_that_sum_to_the_dense_ones(tied, form, monkeypatch):
    """CPU's form sums each row first (exact, the DDP comparisons in test_train.py rely on it); CUDA's adds every
    looked-up row as is (no host sync), run here on CPU."""
    if form == "looked_up":
        monkeypatch.setattr(model_module, "summed_rows", model_module.looked_up_rows)
    torch.manual_seed(0)
    model = get_model({**SMALL, "tie_embeddings": tied})
    batches = micro_batches(3, seed=1)
    reference = dense_sum(model, batches)
    layouts = record_layouts(model)
    for x, y in batches:
        model(x, y)[1].backward()
    for name in TABLES:  # the first micro-step leaves a dense .grad; the next ones add their rows into it
        # a tied wte also takes the head's dense gradient, which autograd sums with its rows before the hook sees it
        sparse = torch.strided if tied and name == "wte.weight" else torch.sparse_coo
        assert layouts[name] == [torch.strided, sparse, sparse], name
    for name, p in model.named_parameters():
        assert p.grad.layout == torch.strided
        if form == "summed":
            assert torch.equal(p.grad, reference[name]), name
        else:
            torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7)  # the sums' order differs
    fresh = get_model({**SMALL, "tie_embeddings": tied})  # the same weights without a .grad: the same forward
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model(*batches[0])[1], fresh(*batches[0])[1])


def test_a_grad_zeroed_between_forward_and_backward_stays_dense():
    """The usual loop (forward, optimizer.zero_grad(), backward, step: tests/test_ship.py's, anyone's with model.py):
    the lookup decides at backward, when .grad is gone, so every gradient is dense and plain Adam takes it."""
    torch.manual_seed(0)
    model = get_model(SMALL)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for x, y in micro_batches(3, seed=2):
        loss = model(x, y)[1]
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad.layout == torch.strided for p in model.parameters())
        optimizer.step()


def ddp_worker(rank, world_size, port):
    init_gloo(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = get_model(SMALL)
        torch.manual_seed(0)
        twin = get_model(SMALL)  # the reference's: its backward passes leave model's .grad alone
        ddp = DDP(model, gradient_as_bucket_view=True)  # as launch.build_model wraps it
        adamw = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        layouts, bucket_views = record_layouts(model), []
        for step in range(3):
            batches = micro_batches(3, seed=10 * step + rank)
            twin.load_state_dict(model.state_dict())
            reference = dense_sum(twin, batches)
            for name, grad in reference.items():
                dist.all_reduce(grad)
                grad /= world_size
            layouts["bigram.weight"].clear()
            for micro, (x, y) in enumerate(batches):
                with ddp.no_sync() if micro < len(batches) - 1 else nullcontext():
                    ddp(x, y)[1].backward()
                if micro == 0 and step == 2:  # kept by zero_grad: the first micro-step added into the buckets
                    assert [p.grad.data_ptr() for p in model.parameters()] == bucket_views
            # step 0 starts without .grad (dense first); later steps with the kept, zeroed ones (all sparse)
            first = torch.strided if step == 0 else torch.sparse_coo
            assert layouts["bigram.weight"] == [first, torch.sparse_coo, torch.sparse_coo]
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-7)
            # .grad are views of DDP's buckets now; it rebuilds them once, in step 1's forward (in the order step 0's
            # gradients came), so from step 1's sync on they stay where they are
            bucket_views = [p.grad.data_ptr() for p in model.parameters()]
            adamw.step()  # fused AdamW takes the dense .grad
            model.zero_grad(set_to_none=False)  # train.py's, after every optimizer step with several ranks
    finally:
        dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_sparse_table_gradients_under_ddp_no_sync_and_bucket_views():
    """2 gloo ranks, DDP with gradient_as_bucket_view, three optimizer steps of 3 micro-steps (no_sync on the first
    two), the gradients zeroed in place between them as train.py does with several ranks: every gradient equals the
    ranks' mean of the dense per-micro-step sums, and stays a view of DDP's bucket from the first sync on."""
    mp.spawn(ddp_worker, args=(2, free_port()), nprocs=2)


@pytest.mark.slow
def test_a_whole_compiled_model_keeps_dense_table_gradients_and_one_graph():
    """Inside a compiled graph the lookup stays dense (inductor cannot take a sparse gradient) and reads no .grad,
    so the micro-steps after the first hit the same graph."""
    torch.manual_seed(0)
    model = get_model(SMALL)
    batches = micro_batches(3, seed=1)
    reference = dense_sum(model, batches)
    compiled = torch.compile(model)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for x, y in batches:
        compiled(x, y)[1].backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-5, atol=1e-6)

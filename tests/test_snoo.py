"""Muon's update smoothing (Muon(update_smoothing=...)) and Snoo (optimizers.Snoo) worked by hand, off = as before, the
schedule leaves Snoo's LR alone, and the flags' way from config.py to the optimizers. Sharded equals one process:
tests/test_muon.py's gloo test; a rollback restores their state: tests/test_rollback.py."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import config
import launch
from muon import Muon, zeropower_via_newtonschulz
from optimizers import Snoo
from schedule import set_lrs

torch.set_num_threads(1)


@pytest.mark.parametrize("shape", [(32, 8), (8, 32), (2, 12, 12)])
def test_the_smoothed_update_is_an_ema_of_the_orthogonalised_one(shape):
    g = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.randn(*shape, generator=g))
    p0 = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False, update_smoothing=0.2)
    grads = [torch.randn(*shape, generator=g) for _ in range(2)]
    scale = math.sqrt(max(1.0, shape[-2] / shape[-1]))
    ema = torch.zeros(shape)
    for grad in grads:  # momentum 0: the direction is the gradient itself
        p.grad = grad
        opt.step()
        ema = 0.2 * ema + 0.8 * zeropower_via_newtonschulz(grad)
        p0 = p0 - 0.1 * scale * ema
        torch.testing.assert_close(p.detach(), p0)
        torch.testing.assert_close(opt.state[p]["smoothed_update"], ema)
    assert opt.state[p]["smoothed_update"].shape == p.shape and opt.state[p]["smoothed_update"].dtype == torch.float32


def test_no_smoothing_is_plain_muon_exactly():
    g = torch.Generator().manual_seed(2)
    p = nn.Parameter(torch.randn(16, 8, generator=g))
    q = nn.Parameter(p.detach().clone())
    plain, off = Muon([p], lr=0.1), Muon([q], lr=0.1, update_smoothing=0.0)
    assert plain.defaults["update_smoothing"] == 0.0  # the default
    for _ in range(3):
        p.grad = torch.randn(16, 8, generator=g)
        q.grad = p.grad.clone()
        plain.step()
        off.step()
    assert torch.equal(p, q) and "smoothed_update" not in off.state[q]
    with pytest.raises(ValueError, match="update_smoothing"):
        Muon([p], update_smoothing=1.0)


def test_snoo_every_k_steps_is_nesterov_sgd_on_the_move_from_the_slow_weights():
    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(6, 4, generator=g)), nn.Parameter(torch.randn(5, generator=g))]
    snoo = Snoo(params, lr=0.68, momentum=0.37, every=3)
    slow = [p.detach().clone() for p in params]  # the weights at construction
    moms = [torch.zeros_like(p) for p in params]
    fired = []
    for step in range(7):
        with torch.no_grad():  # an inner optimizer's step
            for p in params:
                p.sub_(0.1 * torch.randn(p.shape, generator=g))
        inner = [p.detach().clone() for p in params]
        snoo.step()
        if step % 3 == 0:  # the 1st, 4th and 7th steps: the record's count
            fired.append(step)
            for i, (w, s) in enumerate(zip(inner, slow)):
                moms[i] = 0.37 * moms[i] + (w - s)
                slow[i] = s + 0.68 * ((w - s) + 0.37 * moms[i])
        expected = slow if step % 3 == 0 else inner
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.detach(), e)
        for p, s, m in zip(params, slow, moms):
            torch.testing.assert_close(snoo.state[p]["slow"], s)
            torch.testing.assert_close(snoo.state[p]["outer_momentum"], m)
            assert snoo.state[p]["outer_steps"] == step + 1
    assert fired == [0, 3, 6]
    with pytest.raises(ValueError, match="Snoo"):
        Snoo(params, lr=0.0)


def test_the_schedule_leaves_snoos_lr_and_momentum_alone():
    p = nn.Parameter(torch.randn(4, 4))
    muon, snoo = Muon([dict(params=[p])], lr=0.02), Snoo([p], lr=0.68, momentum=0.37, every=28)
    hp = SimpleNamespace(lr_rule="sqrt")
    set_lrs([muon, snoo], hp, lr_frac=0.5, momentum=0.9, step_tokens=4 * 2048, kind="cpu")
    assert muon.param_groups[0]["lr"] == 0.02 * 0.5 * 2 and muon.param_groups[0]["momentum"] == 0.9
    group = snoo.param_groups[0]
    assert (group["outer_lr"], group["outer_momentum"], group["every"]) == (0.68, 0.37, 28) and "lr" not in group


def test_the_flags_reach_the_optimizers():
    hp = config.Hyperparameters()
    assert (hp.muon_smoothing, hp.snoo_lr, hp.snoo_momentum, hp.snoo_every) == (0.2, 0.68, 0.37, 28)  # the records'
    plan = SimpleNamespace(n_layer=2, n_head=2, n_embd=32)
    flags = dict(device="cpu", compile=False, vocab_size=64, seq_len=16)
    _, model, _, optimizers = launch.build_model(
        config.Hyperparameters(**flags), plan, {}, torch.device("cpu"), 1, None
    )
    muon, _, snoo = optimizers
    assert muon.defaults["update_smoothing"] == 0.2 and isinstance(snoo, Snoo)
    assert snoo.param_groups[0]["params"] == list(model.parameters())
    assert (snoo.defaults["outer_lr"], snoo.defaults["outer_momentum"], snoo.defaults["every"]) == (0.68, 0.37, 28)
    off = config.Hyperparameters(muon_smoothing=0.0, snoo_lr=0.0, **flags)
    _, _, _, optimizers = launch.build_model(off, plan, {}, torch.device("cpu"), 1, None)
    assert len(optimizers) == 2 and optimizers[0].defaults["update_smoothing"] == 0.0
    unused = config.overridden_flags(config.Hyperparameters(snoo_lr=0.0, snoo_every=10))
    assert any("--snoo_every 10 is not used" in line for line in unused)

"""NorMuon (muon.normuon_scale, Muon(normuon_beta2=...)): the per-neuron normalisation on small cases worked by hand,
its state, the Muon step it changes, off = plain Muon, and the flag's way from config.py to the optimizer. Sharded
equals single-process: tests/test_muon.py's gloo test, with NorMuon on."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import config
import launch
from muon import Muon, normuon_scale, zeropower_via_newtonschulz
from optimizers import build_optimizers

torch.set_num_threads(1)


def rms(t, dim):
    return t.square().mean(dim=dim).sqrt()


def test_a_tall_update_is_normalised_per_row_by_hand():
    update = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]])  # rows >= columns: one second moment per row
    second_moment = torch.zeros(3, 1)
    factor = normuon_scale(update, second_moment, beta2=0.5)
    # the rows' mean squares are 1, 2 and 0; the EMA from 0 keeps half of them
    torch.testing.assert_close(second_moment, torch.tensor([[0.5], [1.0], [0.0]]))
    # 1 / sqrt(EMA) = sqrt(2), 1, 1e5 (the 1e-10 floor), times ||u|| / ||u x that|| = sqrt(6) / sqrt(8)
    expected = torch.tensor([[math.sqrt(2)], [1.0], [1e5]]) * math.sqrt(6 / 8)
    torch.testing.assert_close(factor, expected)
    normalised = update * factor
    torch.testing.assert_close(rms(normalised[:2], -1), torch.full((2,), math.sqrt(1.5)))  # equal row RMS
    torch.testing.assert_close(normalised.norm(), update.norm())  # Muon's step size kept
    assert torch.equal(normalised[2], torch.zeros(2))

    # the second step: the EMA by hand, 0.5 x the first + 0.5 x the new mean squares (4, 0.5, 1)
    update2 = torch.tensor([[2.0, 2.0], [1.0, 0.0], [1.0, 1.0]])
    factor2 = normuon_scale(update2, second_moment, beta2=0.5)
    torch.testing.assert_close(second_moment, torch.tensor([[2.25], [0.75], [0.5]]))
    step = second_moment.rsqrt()
    torch.testing.assert_close(factor2, step * update2.norm() / (update2 * step).norm())


def test_a_wide_update_is_normalised_per_column_and_a_stack_per_matrix():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 12, generator=g)
    second_moment = torch.zeros(1, 12)  # columns > rows: one second moment per column
    factor = normuon_scale(wide, second_moment, beta2=0.95)
    torch.testing.assert_close(second_moment, 0.05 * wide.square().mean(dim=0, keepdim=True))
    normalised = wide * factor
    torch.testing.assert_close(rms(normalised, 0), rms(normalised, 0).mean().expand(12))  # equal column RMS
    torch.testing.assert_close(normalised.norm(), wide.norm())

    stack = torch.randn(3, 8, 5, generator=g) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]
    moments = torch.zeros(3, 8, 1)
    factors = normuon_scale(stack, moments, beta2=0.9)
    for matrix, moment, factor in zip(stack, moments, factors):  # each matrix on its own, its own norm kept
        alone = torch.zeros(8, 1)
        torch.testing.assert_close(factor, normuon_scale(matrix, alone, beta2=0.9))
        torch.testing.assert_close(moment, alone)
        torch.testing.assert_close((matrix * factor).norm(), matrix.norm())


def test_a_zero_update_gets_a_zero_factor_and_leaves_the_moment():
    second_moment = torch.full((4, 1), 0.25)
    factor = normuon_scale(torch.zeros(4, 4), second_moment, beta2=0.8)
    assert torch.equal(factor, torch.zeros(4, 1))
    torch.testing.assert_close(second_moment, torch.full((4, 1), 0.2))  # decays toward the zero mean square


@pytest.mark.parametrize("shape", [(32, 8), (8, 32), (2, 12, 12)])
def test_a_normuon_step_is_muon_with_the_factor_and_keeps_its_state(shape):
    g = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.randn(*shape, generator=g))
    p0 = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False, normuon_beta2=0.95)
    p.grad = torch.randn(*shape, generator=g)
    opt.step()
    update = zeropower_via_newtonschulz(p.grad)  # momentum 0: the gradient itself
    tall = shape[-2] > shape[-1]
    moment = torch.zeros(opt.state[p]["second_moment"].shape)
    # the step reduces a tall matrix's rows in its wide (transposed) layout, the one Newton-Schulz iterates on
    factor = normuon_scale(update.mT.contiguous(), moment.mT, 0.95).mT if tall else normuon_scale(update, moment, 0.95)
    scale = math.sqrt(max(1.0, shape[-2] / shape[-1]))
    torch.testing.assert_close(p.detach(), p0 - 0.1 * scale * update * factor)
    kept_rows = shape[-2] >= shape[-1]
    assert opt.state[p]["second_moment"].shape == ((*shape[:-1], 1) if kept_rows else (*shape[:-2], 1, shape[-1]))
    assert torch.equal(opt.state[p]["second_moment"], moment)
    assert not torch.equal(factor, torch.ones_like(factor))  # the factor moved the step


def test_off_is_plain_muon_exactly():
    g = torch.Generator().manual_seed(2)
    p = nn.Parameter(torch.randn(16, 8, generator=g))
    p0 = p.detach().clone()
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False)
    assert opt.param_groups[0]["normuon_beta2"] == 0.0  # the default
    p.grad = torch.randn(16, 8, generator=g)
    opt.step()
    assert torch.equal(p.detach(), p0 + zeropower_via_newtonschulz(p.grad) * (-0.1 * math.sqrt(2)))
    assert set(opt.state[p]) == {"momentum_buffer"}
    with pytest.raises(ValueError, match="normuon_beta2"):
        Muon([p], normuon_beta2=1.0)


def test_the_flag_reaches_the_muon_group():
    assert config.Hyperparameters().normuon_beta2 == 0.95  # the record's, adopted (BENCHMARKS.md, "NorMuon")
    plan = SimpleNamespace(n_layer=2, n_head=2, n_embd=32)
    for beta2 in (0.95, 0.0):  # the default, and plain Muon
        hp = config.Hyperparameters(normuon_beta2=beta2, device="cpu", compile=False, vocab_size=64, seq_len=16)
        _, _, _, optimizers = launch.build_model(hp, plan, {}, torch.device("cpu"), 1, None)
        assert [g["normuon_beta2"] for g in optimizers[0].param_groups] == [beta2]
    model = nn.Sequential(nn.Linear(4, 4))
    assert (
        build_optimizers(model, muon_lr=0.02, embed_lr=0.1, head_lr=0.1, scalar_lr=0.1)[0].defaults["normuon_beta2"]
        == 0.0
    )

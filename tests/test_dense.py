"""MUDD's dense mixes (model.py --mudd): off is today's model, on at its init computes exactly what off computes, the
mixes learn, a checkpoint loads with model.py alone at a longer length, per-block compile makes no new graph."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from headloss import compiled_head_loss, head_loss  # noqa: E402
from model import FIRST_KEYS, DenseMix, get_model  # noqa: E402
from optimizers import build_optimizers  # noqa: E402
from report import compiled_graphs, planned_graphs  # noqa: E402

torch.set_num_threads(1)
SMALL = dict(n_layer=6, n_embd=32, n_head=2, vocab_size=96, seq_len=16)


def build(**overrides):
    torch.manual_seed(0)
    return get_model({**SMALL, **overrides})


def tokens(T=16, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (3, T), generator=torch.Generator().manual_seed(seed))


def moved(model, skip="mudd."):
    """Every weight but MUDD's moved by the same noise: the zero-init projections and head would otherwise leave
    every gradient but the head's at zero, and the comparison below would be empty."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(skip):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def loss_and_grads(model, T=16):
    idx = tokens(T)
    loss = model(idx, torch.roll(idx, -1, dims=1))[1]
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_off_is_todays_model_and_an_old_checkpoint_config_builds_it_off():
    """Off, the model before MUDD: the same weights as on (drawn alike) without the mixes, and no mixes computed."""
    on, off = build(), build(mudd=False)
    assert on.config.mudd and on.mudd is not None and off.mudd is None  # on by default
    theirs = {k: v for k, v in on.state_dict().items() if not k.startswith("mudd.")}
    assert off.state_dict().keys() == theirs.keys() and all(
        torch.equal(v, theirs[k]) for k, v in off.state_dict().items()
    )
    assert not any(isinstance(m, DenseMix) for m in off.modules())
    old = {k: v for k, v in dataclasses.asdict(on.config).items() if k in FIRST_KEYS}  # a checkpoint before MUDD
    assert get_model(old).mudd is None and get_model({**old, "mudd": True}).mudd is not None


@pytest.mark.parametrize("overrides", [{}, {"value_embeds": False}, {"n_layer": 16}, {"n_layer": 3, "backout": False}])
def test_on_at_init_computes_exactly_what_off_computes(overrides):
    """The mixes start as nothing and are built after every other weight is drawn: the same weights, loss and
    gradients as without them, torch.equal. (At 2 layers every tap is block 0's output, whose gradient then sums
    its consumers in another order: equal within rounding, the last test here.)"""
    off, on = moved(build(mudd=False, **overrides)), moved(build(mudd=True, **overrides))
    loss_off, grads_off = loss_and_grads(off)
    loss_on, grads_on = loss_and_grads(on)
    assert torch.equal(loss_off, loss_on)
    for name, grad in grads_off.items():
        assert torch.equal(dict(off.named_parameters())[name], dict(on.named_parameters())[name]), name
        assert torch.equal(grad, grads_on[name]), name
    mudd = {n: g for n, g in grads_on.items() if n.startswith("mudd.")}
    assert mudd and all(g is not None for g in mudd.values())
    assert all(g.abs().sum() > 0 for n, g in mudd.items() if ".w2." in n)  # the zero layer learns first


def test_the_mixes_change_the_output_and_every_mudd_weight_learns():
    model = moved(build(mudd=True))
    idx = tokens()
    with torch.no_grad():
        before = model(idx)[0]
        for mix in model.mudd:
            mix.w2.weight.normal_(0.0, 1.0)
    _, grads = loss_and_grads(model)
    with torch.no_grad():
        assert (model(idx)[0] - before).abs().max() > 1e-3
    assert all(grads[n].abs().sum() > 0 for n in grads if n.startswith("mudd."))
    assert build(mudd=True, n_layer=1).mudd is None  # one layer: no block before the last to mix from
    (loss_off, grads_off), (loss_on, grads_on) = [loss_and_grads(moved(build(n_layer=2, mudd=m))) for m in (0, 1)]
    assert torch.equal(loss_off, loss_on)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7)


def test_the_mixes_train_in_the_gate_group():
    model = build(mudd=True)
    optimizers = build_optimizers(model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    groups = {g["name"]: g for opt in optimizers for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    in_gate = {names[id(p)] for p in groups["gate"]["params"]}
    assert {n for n in names.values() if n.startswith("mudd.")} <= in_gate
    assert groups["gate"]["lr"] == 0.04 * model.config.gate_lr_mult and groups["gate"]["cautious_wd"] == 0.0
    assert not any(names[id(p)].startswith("mudd.") for p in groups["muon"]["params"])


ORGANIZER = """
import json, torch
from model import get_model
torch.set_num_threads(1)
ckpt = torch.load("checkpoint.pt", weights_only=True)
model = get_model(ckpt["config"])
model.load_state_dict(ckpt["model"])
idx = torch.load("reference.pt", weights_only=True)["idx"]
with torch.no_grad():
    logits, loss = model(idx, idx)
torch.save(logits, "organizer_logits.pt")
print(json.dumps({"mudd": model.mudd is not None, "loss": loss.item()}))
"""


def test_a_mudd_checkpoint_loads_with_model_py_alone_at_a_longer_length(tmp_path):
    model = build(mudd=True)
    moved(model, skip="")  # the mixes too: a checkpoint whose every MUDD weight matters
    idx = tokens(T=3 * SMALL["seq_len"], seed=7)  # three times the training length
    with torch.no_grad():
        reference = model(idx)[0]
    config = dataclasses.asdict(model.config)
    torch.save({"model": model.state_dict(), "config": config}, tmp_path / "checkpoint.pt")
    torch.save({"idx": idx}, tmp_path / "reference.pt")
    shutil.copy(ROOT / "model.py", tmp_path / "model.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", ORGANIZER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert '"mudd": true' in run.stdout
    assert torch.equal(torch.load(tmp_path / "organizer_logits.pt", weights_only=True), reference)


@pytest.mark.slow
def test_per_block_compile_with_mudd_makes_only_the_planned_graphs_and_matches_eager():
    """The last block takes its value embedding through the same input, so no block is a graph of its own; each mix
    is one, and a second step compiles nothing."""
    torch._dynamo.reset()
    cfg = dict(n_layer=4, n_embd=32, n_head=2, zero_init_proj=False, mudd=True)
    eager_model, compiled_model = moved(build(**cfg), skip=""), moved(build(**cfg), skip="")
    eager_loss, eager_grads = loss_and_grads_with(eager_model, head_loss)
    before = compiled_graphs()
    compiled_model.compile_per_block()
    compiled_loss, compiled_grads = loss_and_grads_with(compiled_model, compiled_head_loss())
    assert (
        compiled_graphs() - before == planned_graphs(compiled_model, 3 * 16, "cpu") == 4
    )  # a block kind, 2 mixes, a chunk
    compiled_model.zero_grad(set_to_none=True)
    with torch.compiler.set_stance("fail_on_recompile"):
        loss_and_grads_with(compiled_model, compiled_head_loss())
    assert abs(compiled_loss.item() - eager_loss.item()) < 1e-5
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-4, rtol=1e-3)


def loss_and_grads_with(model, loss_fn):
    idx = tokens()
    loss = model(idx, torch.roll(idx, -1, dims=1), loss_fn=loss_fn)[1]
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}

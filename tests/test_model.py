"""model.py under the organizers' contract: get_model(config) -> forward(idx, targets) -> (logits, loss)."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import model as model_module  # noqa: E402
import headloss  # noqa: E402
from model import get_model  # noqa: E402
from headloss import compiled_head_loss, head_loss  # noqa: E402
from report import planned_graphs  # noqa: E402

# vocab 500 is not a multiple of 128, so the padded head is exercised too
SMALL = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=500, seq_len=32)


def build(**overrides):
    torch.manual_seed(0)
    return get_model({**SMALL, **overrides})


def tokens(B, T, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def logits_of(model, idx):
    with torch.no_grad():
        return model(idx)[0]


# ---- the organizers' process: a folder holding model.py and nothing else from this repo ----

TRAIN_AND_SAVE = """
import json, sys, torch
import model as model_file
from model import get_model
torch.set_num_threads(1)
torch.manual_seed(0)
out = {"model_file": model_file.__file__, "sys_path": sys.path}
logits, _ = get_model({})(torch.randint(0, 32000, (1, 3)))
out["default_shape"] = list(logits.shape)
cfg = {**SMALL, "lr": 1, "foo": "bar"}
model = get_model(cfg)
opt = torch.optim.SGD(model.parameters(), lr=0.5)
for _ in range(3):  # zero-initialised projections need a few steps before every weight moves
    x = torch.randint(0, SMALL["vocab_size"], (2, SMALL["seq_len"] + 1))
    loss = model(x[:, :-1], x[:, 1:])[1]
    opt.zero_grad(); loss.backward(); opt.step()
out["shapes"] = {T: list(model(torch.randint(0, SMALL["vocab_size"], (2, T)))[0].shape)
                 for T in (1, 7, SMALL["seq_len"], 3 * SMALL["seq_len"])}
out["attn_proj_trained"] = bool(model.blocks[0].attn.c_proj.weight.abs().sum() > 0)
idx = torch.randint(0, SMALL["vocab_size"], (2, 3 * SMALL["seq_len"]))
with torch.no_grad():
    torch.save({"idx": idx, "logits": model(idx)[0]}, "reference.pt")
torch.save({"model": model.state_dict(), "config": cfg}, "checkpoint.pt")
print(json.dumps(out))
"""

ORGANIZER = """
import torch
from model import get_model
torch.set_num_threads(1)
ckpt = torch.load("checkpoint.pt", weights_only=True)
model = get_model(ckpt["config"])
model.load_state_dict(ckpt["model"])
idx = torch.load("reference.pt", weights_only=True)["idx"]
with torch.no_grad():
    logits, loss = model(idx)
torch.save(logits, "organizer_logits.pt")
"""


def run_alone(folder, code):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", f"SMALL = {SMALL!r}\n{code}"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_organizer_snippet_with_model_py_alone(tmp_path):
    shutil.copy(ROOT / "model.py", tmp_path / "model.py")
    out = json.loads(run_alone(tmp_path, TRAIN_AND_SAVE).splitlines()[-1])
    assert Path(out["model_file"]).resolve().parent == tmp_path.resolve()
    assert all(Path(p or ".").resolve() != ROOT for p in out["sys_path"] if p != "")

    assert out["default_shape"][:2] == [1, 3] and out["default_shape"][2] >= 32000
    for T, shape in out["shapes"].items():
        assert shape[:2] == [2, int(T)] and shape[2] >= SMALL["vocab_size"]
    assert out["attn_proj_trained"]

    run_alone(tmp_path, ORGANIZER)  # a fresh process, as the organizers run it
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)["logits"]
    assert reference.std() > 0
    assert torch.equal(torch.load(tmp_path / "organizer_logits.pt", weights_only=True), reference)


# ---- loss, dtypes, compile ----


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"zero_init_proj": False}])
def test_loss_is_plain_mean_cross_entropy(overrides):
    model = build(**overrides)
    idx, targets = tokens(2, 16), tokens(2, 16, seed=2)
    logits, loss = model(idx, targets)
    V = logits.size(-1)
    assert logits.shape == (2, 16, V) and V >= SMALL["vocab_size"]
    assert logits.dtype == loss.dtype == torch.float32
    assert torch.allclose(loss, F.cross_entropy(logits.float().view(-1, V), targets.view(-1)))
    assert abs(loss.item() - math.log(V)) < 1.0
    assert model(idx)[1] is None


def test_bf16_autocast_is_finite_and_close_to_fp32():
    model = build(zero_init_proj=False)  # so every block contributes to the output
    idx, targets = tokens(2, SMALL["seq_len"]), tokens(2, SMALL["seq_len"], seed=2)
    with torch.no_grad():
        _, loss32 = model(idx, targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits16, loss16 = model(idx, targets)
    assert torch.isfinite(logits16).all() and torch.isfinite(loss16)
    assert abs(loss16.item() - loss32.item()) < 0.1


@pytest.mark.slow
def test_compiled_forward_matches_eager_and_state_dict_stays_plain(tmp_path):
    cfg = dict(SMALL, n_layer=2, n_embd=32, n_head=2, zero_init_proj=False)
    torch.manual_seed(0)
    model = get_model(cfg)
    idx = tokens(2, 16)
    eager = logits_of(model, idx)
    compiled = torch.compile(model)
    assert torch.allclose(logits_of(compiled, idx), eager, atol=1e-5, rtol=1e-4)

    state = model.state_dict()
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in state)
    torch.save({"model": state, "config": dataclasses.asdict(model.config)}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = get_model(ckpt["config"])
    fresh.load_state_dict(ckpt["model"])  # strict: no missing or unexpected keys
    assert torch.equal(logits_of(fresh, idx), eager)


# ---- gradients and feature switches ----

ALL_OFF = dict(
    qk_norm=False,
    value_embeds=False,
    x0_mix=False,
    resid_scale=False,
    unet_skips=False,
    zero_init_proj=False,
    embed_norm=False,
    tie_embeddings=False,
    logit_softcap=0.0,
    bigram_mult=0.0,
    backout=False,
    ve_gate=False,
    mudd=False,
)


@pytest.mark.parametrize(
    "overrides", [{}, ALL_OFF, {"tie_embeddings": True}, {"pos": "learned", "norm": "layer", "mlp_act": "gelu"}]
)
def test_every_parameter_gets_a_gradient(overrides):
    model = build(**overrides)
    model(tokens(2, 16), tokens(2, 16, seed=2))[1].backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    if not model.config.zero_init_proj:  # with nothing zeroed, every tensor actually learns
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())


def fill(suffix, value):
    """Set every parameter whose name ends with suffix to value (broadcast)."""

    def apply(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(suffix):
                    p.copy_(torch.as_tensor(value).expand_as(p))

    return apply


def head_is_embedding(model):
    with torch.no_grad():
        model.lm_head.weight.copy_(model.wte.weight)


# (key, value A, value B, make the feature visible in A, make A compute exactly what B computes)
SWITCHES = [
    ("qk_norm", True, False, None, None),
    ("embed_norm", True, False, None, None),
    ("mlp_act", "relu2", "gelu", None, None),
    ("norm", "rms", "layer", None, None),
    ("pos", "rope", "learned", None, None),
    ("value_embeds", True, False, None, fill("ve_lambdas", [1.0, 0.0])),
    ("x0_mix", True, False, fill("x0_lambda", 0.5), fill("x0_lambda", 0.0)),
    ("resid_scale", True, False, fill("resid_lambda", 0.5), fill("resid_lambda", 1.0)),
    ("unet_skips", True, False, None, fill("skip_weights", 0.0)),
    ("tie_embeddings", False, True, None, head_is_embedding),
]


@pytest.mark.parametrize("key, a, b, make_visible, make_equivalent", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_each_switch_changes_the_computation(key, a, b, make_visible, make_equivalent):
    model_a = build(zero_init_proj=False, **{key: a})
    model_b = build(zero_init_proj=False, **{key: b})
    if make_visible:
        make_visible(model_a)
    # B gets A's values wherever they share a parameter, so only the switch can tell them apart
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    shared = {k: v for k, v in state_a.items() if k in state_b and state_b[k].shape == v.shape}
    assert set(shared) >= {"wte.weight", "blocks.0.attn.c_q.weight", "blocks.3.mlp.c_proj.weight"}
    model_b.load_state_dict(shared, strict=False)

    idx = tokens(2, 16)
    out_a, out_b = logits_of(model_a, idx), logits_of(model_b, idx)
    assert (out_a - out_b).abs().max() > 1e-3 * out_a.abs().max()
    if make_equivalent:  # the switch's learnable knobs at their neutral values reproduce B exactly
        make_equivalent(model_a)
        assert torch.allclose(logits_of(model_a, idx), out_b, atol=1e-5, rtol=1e-5)


def test_zero_init_proj_zeroes_the_output_projections_only():
    zeroed, random = build(zero_init_proj=True), build(zero_init_proj=False)
    assert zeroed.state_dict().keys() == random.state_dict().keys()
    projections = [n for n, _ in zeroed.named_parameters() if n.endswith("c_proj.weight")] + ["lm_head.weight"]
    for name, p in zeroed.named_parameters():
        # zero by design, as x0_lambda: the gates, the bigram table, MUDD's output layers
        if p.dim() == 2 and not name.endswith(("gate.weight", "bigram.weight", "w2.weight")):
            assert (p.abs().sum() == 0) == (name in projections), name
    assert all(random.get_parameter(n).abs().sum() > 0 for n in projections)
    idx = tokens(2, 16)
    assert torch.equal(logits_of(zeroed, idx), torch.zeros_like(logits_of(zeroed, idx)))
    assert logits_of(random, idx).abs().max() > 0


def test_logit_softcap_bounds_the_logits():
    capped, uncapped = build(logit_softcap=15.0), build(logit_softcap=0.0)
    with torch.no_grad():
        capped.lm_head.weight.normal_(0.0, 1.0)  # logits far beyond the cap
    uncapped.load_state_dict(capped.state_dict())
    idx = tokens(2, 16)
    raw, soft = logits_of(uncapped, idx), logits_of(capped, idx)
    assert raw.abs().max() > 30 and soft.abs().max() < 15
    assert torch.allclose(soft, 15.0 * torch.tanh(raw / 15.0), atol=1e-5)


def test_softcap_hand_written_backward_matches_autograd():
    from model import SoftCap

    z = (torch.randn(3, 5, 7, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: SoftCap.apply(t, 15.0), (z,))
    grad = torch.randn(3, 5, 7, dtype=torch.float64)
    (mine,) = torch.autograd.grad(SoftCap.apply(z, 15.0), z, grad)
    (reference,) = torch.autograd.grad(15.0 * torch.tanh(z), z, grad)
    assert torch.allclose(mine, reference)


# ---- the chunked head + loss (headloss.py): forward(idx, targets, loss_fn=head_loss) ----


@pytest.fixture
def chunks_of_24(monkeypatch):
    """24 rows a chunk at the padded vocabulary of 512: 2 x 32 tokens make chunks of 24, 24 and 16."""
    monkeypatch.setitem(headloss.LOSS_CHUNK_BYTES, "cpu", 24 * 4 * 512)


def loss_and_grads(model, idx, targets, autocast=False, **kwargs):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, targets, **kwargs)[1]
    loss.backward()
    return loss.detach(), {name.removeprefix("_orig_mod."): p.grad for name, p in model.named_parameters()}


def capped_batch(model, B=2, T=32):
    """Head weights that push the logits well past the cap (15), and a few targets ignored (-100)."""
    with torch.no_grad():
        (model.lm_head or model.wte).weight.normal_(0.0, 1.0)
    targets = tokens(B, T, seed=2)
    targets[0, :5] = -100
    return tokens(B, T), targets


def assert_grads_close(grads, reference, rel):
    for name, g in reference.items():
        assert (grads[name] - g).norm() <= rel * g.norm() + 1e-8, name


@pytest.mark.parametrize(
    "overrides",
    [{}, {"logit_softcap": 0.0}, {"tie_embeddings": True}, {"tie_embeddings": True, "logit_softcap": 0.0}],
    ids=["capped", "uncapped", "tied_capped", "tied_uncapped"],
)
def test_chunked_loss_and_gradients_equal_the_full_logits_path(overrides, chunks_of_24):
    model = build(zero_init_proj=False, **overrides)
    idx, targets = capped_batch(model)
    full_loss, full_grads = loss_and_grads(model, idx, targets)
    assert full_loss > 2 * math.log(model.padded_vocab)  # far from the init loss: the cap is doing something
    loss, grads = loss_and_grads(model, idx, targets, loss_fn=head_loss)
    assert abs(loss.item() - full_loss.item()) < 1e-5 and loss.dtype == torch.float32
    assert_grads_close(grads, full_grads, 1e-3)  # float32 sums in another order (the exact check: gradcheck below)


def test_chunked_loss_under_bf16_autocast(chunks_of_24):
    model = build(zero_init_proj=False)
    idx, targets = capped_batch(model)
    loss32, grads32 = loss_and_grads(model, idx, targets)
    full16, full_grads16 = loss_and_grads(model, idx, targets, autocast=True)
    loss16, grads16 = loss_and_grads(model, idx, targets, autocast=True, loss_fn=head_loss)
    assert loss16.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads16.values())
    assert abs(loss16.item() - full16.item()) < 2e-2 and abs(loss16.item() - loss32.item()) < 2e-2
    # the matrices' gradients within bf16 rounding (both paths are ~0.5% off float32; a scalar's sum can cancel)
    matrices = {name: g for name, g in grads32.items() if g.dim() == 2}
    assert_grads_close(grads16, matrices, 2e-2)
    assert_grads_close(full_grads16, matrices, 2e-2)


@pytest.mark.parametrize("cap", [0.0, 15.0])
def test_head_loss_gradcheck_float64_untied_and_tied(cap):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = (4 * torch.randn(11, 5, dtype=torch.float64, generator=gen)).requires_grad_()  # logits past the cap
    targets = torch.randint(0, 11, (7,), generator=gen)
    targets[2] = -100
    logits = cap * torch.tanh(x @ weight.T / cap) if cap else x @ weight.T
    assert torch.allclose(head_loss(x, weight, targets, cap, rows=3), F.cross_entropy(logits, targets), rtol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w: head_loss(x, w, targets, cap, rows=3), (x, weight))
    # tied: the weight is also the embedding the hidden states come from, and its two gradients add up
    idx = torch.randint(0, 11, (7,), generator=gen)
    assert torch.autograd.gradcheck(lambda w: head_loss(F.embedding(idx, w).tanh(), w, targets, cap, rows=3), (weight,))


class LargestOutput(TorchDispatchMode):
    """The most elements any op returned while active, backward included."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def test_chunked_path_never_holds_the_full_logits(chunks_of_24):
    model = build(bigram_mult=0.0)  # its table (2,500 x 64) would outsize these logits
    idx, targets = tokens(4, 32), tokens(4, 32, seed=2)  # 128 x 512 logits: more than any weight (512 x 64)
    for loss_fn in (None, head_loss):
        with LargestOutput() as largest:
            model(idx, targets, loss_fn=loss_fn)[1].backward()
        assert (largest.numel >= 4 * 32 * model.padded_vocab) == (loss_fn is None)


def test_chunked_loss_for_evaluation_and_misuse(chunks_of_24):
    model = build(zero_init_proj=False)
    idx, targets = capped_batch(model)
    with torch.no_grad():
        loss, full = model(idx, targets, loss_fn=head_loss)[1], model(idx, targets)[1]
    assert abs(loss.item() - full.item()) < 1e-5 and not loss.requires_grad
    with pytest.raises(ValueError, match="targets"):
        model(idx, loss_fn=head_loss)


@pytest.mark.parametrize("mode", [pytest.param("whole", marks=pytest.mark.slow), "per_block"])
def test_compiled_training_step_matches_eager(chunks_of_24, mode):
    model = build(n_layer=1, n_embd=32, n_head=2, zero_init_proj=False)
    idx, targets = capped_batch(model)
    eager_loss, eager_grads = loss_and_grads(model, idx, targets, loss_fn=head_loss)
    if mode == "whole":
        compiled, loss_fn = torch.compile(model, fullgraph=True), head_loss
    else:  # train.py's: each block and the head's chunk loss math (chunks of 24, 24, 16: two graphs)
        model.compile_per_block()
        compiled, loss_fn = model, compiled_head_loss()
    compiled_loss, compiled_grads = loss_and_grads(compiled, idx, targets, loss_fn=loss_fn)
    assert abs(compiled_loss.item() - eager_loss.item()) < 1e-5
    assert_grads_close(compiled_grads, eager_grads, 1e-4)
    assert all("_orig_mod" not in name for name in model.state_dict())


def test_compiled_uncapped_chunk_loss_matches_eager():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = torch.randn(100, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 100, (40,), generator=gen)
    compiled = torch.compile(headloss.chunk_loss, fullgraph=True, dynamic=False)
    results = []
    for chunk_fn in (headloss.chunk_loss, compiled):
        loss = head_loss(x, weight, targets, 0.0, rows=24, chunk_fn=chunk_fn)
        results.append((loss, *torch.autograd.grad(loss, (x, weight))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


# ---- ReLU² and RoPE ----


def test_relu_squared_backward_matches_autograd():
    h = torch.randn(4, 64, dtype=torch.float64)
    h = (h + 0.1 * h.sign()).requires_grad_()  # away from the kink at 0
    assert torch.autograd.gradcheck(model_module.ReluSquared.apply, (h,))
    g = torch.randn(4, 64, dtype=torch.float64)
    (ours,) = torch.autograd.grad(model_module.ReluSquared.apply(h), h, g)
    (ref,) = torch.autograd.grad(F.relu(h).square(), h, g)
    assert torch.equal(ours, ref)


def test_rotary_turns_each_pair_by_its_position_angle():
    B, T, H, D, base = 2, 7, 3, 8, 100.0
    x = torch.randn(B, T, H, D)
    y = model_module.apply_rotary(x, *model_module.Rotary(D, base)(T, x.device))
    angle = torch.arange(T)[:, None] * base ** (-torch.arange(0, D, 2) / D)  # (T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    torch.testing.assert_close(y, torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1))
    # a rotation: norms kept, and q.k depends on the positions' difference only
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    same = torch.randn(1, 1, 1, D).expand(1, T, 1, D)
    r = model_module.apply_rotary(same, *model_module.Rotary(D, base)(T, x.device))[0, :, 0]
    torch.testing.assert_close((r[1:] * r[:-1]).sum(-1), (r[1:2] * r[:1]).sum(-1).expand(T - 1))


# ---- lengths and errors ----


def test_rope_serves_any_length_and_stays_out_of_the_state_dict():
    model = build()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.02)  # non-zero logits, so prefixes can be compared
    long_idx = tokens(1, 5 * SMALL["seq_len"])
    short = logits_of(model, long_idx[:, :8])
    longer = logits_of(model, long_idx)  # T beyond both the previous T and seq_len
    assert torch.allclose(longer[:, :8], short, atol=1e-5)  # causal: a longer input leaves the prefix alone
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}


def test_rope_first_used_under_inference_mode_still_trains():
    model = build()
    with torch.inference_mode():  # e.g. a validation pass at a new, longer T
        model(tokens(2, 2 * SMALL["seq_len"]))
    model(tokens(2, SMALL["seq_len"]), tokens(2, SMALL["seq_len"], seed=2))[1].backward()


def test_learned_positions_reject_long_inputs():
    model = build(pos="learned")
    model(tokens(1, SMALL["seq_len"]))
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(1, SMALL["seq_len"] + 1))


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"norm": "foo"}, "norm"),
        ({"pos": "alibi"}, "pos"),
        ({"mlp_act": "swish"}, "mlp_act"),
        ({"n_head": 3}, "n_head"),
    ],
)
def test_bad_config_raises_value_error_naming_the_key(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        build(**overrides)


def test_model_switches_out_of_range_are_one_sentence():
    from model import get_model

    for bad in ({"mlp_ratio": 0}, {"rope_base": 1.0}, {"logit_softcap": -1.0}, {"logit_softcap": float("nan")}):
        with pytest.raises(ValueError, match="mlp_ratio must be"):
            get_model({"vocab_size": 64, "n_layer": 1, "n_head": 1, "n_embd": 8, **bad})


# ---- accounting for train.py ----


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"pos": "learned"}])
def test_param_counts(overrides):
    model = build(**overrides)
    cfg = model.config
    total = model.num_params()
    assert total == sum(t.numel() for t in model.state_dict().values())
    tables = ("value_embeds.", "wpe.", "bigram.") + (("wte.",) if not cfg.tie_embeddings else ())
    lookup = sum(p.numel() for n, p in model.named_parameters() if n.startswith(tables))
    assert model.num_params(non_embedding=True) == total - lookup < total
    # flops_per_token is checked against torch's FLOP counter in tests/test_plan.py


def test_chunk_rows_are_tiles_of_128_that_divide_the_micro_batch_when_they_can():
    event_cuda = headloss.LOSS_CHUNK_BYTES["cuda"]
    # l16w1024, micro-batch 26 x 1024 tokens, 32K vocabulary: 8 equal chunks of 3,328 rows (512 MB caps at 4,096)
    assert headloss.chunk_rows(26 * 1024, 32000, event_cuda) == 3328
    assert headloss.chunk_rows(8 * 1024, 32000, headloss.LOSS_CHUNK_BYTES["cpu"]) == 512
    # 37 x 128 rows: no tile multiple in the upper half of the cap divides it, so the last chunk is ragged
    assert headloss.chunk_rows(37 * 128, 32000, event_cuda) == 4096
    assert headloss.chunk_rows(1000, 32000, event_cuda) == 1000  # all rows fit in one chunk
    model = get_model({"vocab_size": 32000, "n_layer": 16, "n_head": 2, "n_embd": 32})
    assert planned_graphs(model, 26 * 1024, "cuda") == 5  # two kinds of block, MUDD's two mixes, one chunk shape
    assert planned_graphs(model, 37 * 128, "cuda") == 6  # and a ragged last chunk
    assert planned_graphs(get_model({"vocab_size": 512, "n_layer": 2, "value_embeds": False}), 64, "cpu") == 4
    assert planned_graphs(get_model({"vocab_size": 512, "n_layer": 2, "mudd": False}), 64, "cpu") == 2

"""headloss.py's two forms of the chunk loss math, the in-place one (eager, and compiled on CPU) and the functional
one (compiled on CUDA), which must agree: the same row losses, and gradients within bf16 rounding; and multi-token
prediction (--mtp) fused into both: a weighted sum of per-target cross-entropies, weights as data."""

import functools
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import headloss  # noqa: E402
import train  # noqa: E402
from headloss import chunk_loss, compiled_head_loss, functional_chunk_loss, head_loss  # noqa: E402
from model import get_model  # noqa: E402
from conftest import LONG_BUDGET, TINY, VOCAB, child_env, command, on_tokens, read_metrics  # noqa: E402

CAPS = [0.0, 15.0, 2.5, 30.0]  # uncapped, the default, and any finite cap >= 0 the model allows
DTYPES = [torch.float32, torch.bfloat16]


def chunk(rows, vocab, dtype, k=1, seed=0):
    """A chunk as HeadLoss hands it over: the matmul's output (spread past the caps), targets (rows, k) and their
    mix (k = 3: --mtp's first weights, one row's extra targets ignored)."""
    gen = torch.Generator().manual_seed(seed)
    y = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (rows, k), generator=gen)
    mix = torch.ones(rows, 1) if k == 1 else torch.tensor([1.0, 0.5, 0.25]).repeat(rows, 1)
    mix[0, 1:] = 0
    return y, targets, mix / mix.sum(1, keepdim=True)


def assert_g_close(g, reference, total):
    """Gradients within bf16 rounding: one unit in the last place of the reference (2^-7 of it: both forms round a
    float32 value to bf16's 8 significant bits, and two float32 values a hair apart can round to neighbours), plus
    the float32 difference of the row sum, which only the target column (e - total) carries (1e-6 of the total).
    In float32 the first term is far looser than needed; the second bounds the summation order."""
    assert g.dtype == reference.dtype
    bound = 2**-7 * reference.float().abs() + 1e-6 * total
    assert ((g.float() - reference.float()).abs() <= bound).all()


@pytest.mark.parametrize("k", [1, 3], ids=["next_token", "mtp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cap", CAPS)
def test_functional_chunk_loss_equals_the_in_place_one(cap, dtype, k):
    y, targets, mix = chunk(24, 512, dtype, k)
    loss, total, g = functional_chunk_loss(y, targets, mix, cap, True)
    ref_loss, ref_total, ref_g = chunk_loss(y.clone(), targets, mix, cap, True)
    assert loss.dtype == torch.float32 and g.dtype == dtype  # upcast inside, g back in the matmul's dtype
    assert (loss - ref_loss).abs().max() < 1e-5 and torch.allclose(total, ref_total, rtol=1e-6)
    assert_g_close(g, ref_g, ref_total)
    assert functional_chunk_loss(y, targets, mix, cap, False)[2] is None
    assert torch.equal(y, chunk(24, 512, dtype, k)[0])  # its input untouched: nothing in place


def head_inputs(dtype_seed=0):
    """40 rows of width 16 against a vocabulary of 512: chunks of 16 rows make a ragged last chunk of 8; three
    targets ignored (-100), one of them in the ragged chunk."""
    gen = torch.Generator().manual_seed(dtype_seed)
    x = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = (2 * torch.randn(512, 16, generator=gen)).requires_grad_()
    targets = torch.randint(0, 512, (40,), generator=gen)
    targets[[3, 17, 38]] = -100
    return x, weight, targets


def loss_and_grads(x, weight, targets, cap, dtype, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = head_loss(x, weight, targets, cap, rows=16, **kwargs)
    return (loss, *torch.autograd.grad(loss, (x, weight)))


def assert_head_close(results, reference):
    """The mean loss within 1e-5; dx and dweight (the chunks' g through two matmuls, summed in float32) within
    bf16's relative rounding of their norms."""
    (loss, dx, dw), (ref_loss, ref_dx, ref_dw) = results, reference
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for grad, ref in ((dx, ref_dx), (dw, ref_dw)):
        assert (grad - ref).norm() <= 2**-7 * ref.norm()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cap", CAPS)
def test_head_loss_through_the_functional_form_equals_the_in_place_one(cap, dtype):
    x, weight, targets = head_inputs()
    reference = loss_and_grads(x, weight, targets, cap, dtype)
    assert_head_close(loss_and_grads(x, weight, targets, cap, dtype, chunk_fn=functional_chunk_loss), reference)


@pytest.mark.parametrize("cap,dtype", [(15.0, torch.bfloat16), (0.0, torch.float32)], ids=["capped_bf16", "fp32"])
def test_compiled_functional_form_equals_the_eager_in_place_one(cap, dtype):
    """Compiled, over a ragged last chunk and ignored targets: the head loss through the functional form against the
    eager in-place head loss."""
    x, weight, targets = head_inputs()
    reference = loss_and_grads(x, weight, targets, cap, dtype)
    compiled = torch.compile(functional_chunk_loss, fullgraph=True, dynamic=False)
    assert_head_close(loss_and_grads(x, weight, targets, cap, dtype, chunk_fn=compiled), reference)


def test_compiled_head_loss_traces_the_devices_form_and_runs_the_in_place_one_eagerly(monkeypatch):
    """compiled_head_loss compiles compiled_chunk_loss: traced, the device's TRACED_FORMS entry (CUDA: functional;
    CPU: none, so in place, which writes into its float32 input); run eagerly (the force_eager stance of a failed
    compile or a guard miss), the in-place form, which makes fewer passes than the functional one."""
    assert headloss.TRACED_FORMS == {"cuda": functional_chunk_loss}
    compiled = compiled_head_loss().keywords["chunk_fn"]
    assert compiled.__wrapped__ is headloss.compiled_chunk_loss
    y, targets, mix = chunk(16, 512, torch.float32)
    compiled(y, targets, mix, 15.0, True)
    assert not torch.equal(y, chunk(16, 512, torch.float32)[0])  # traced on CPU: in place
    with monkeypatch.context() as patch:
        patch.setitem(headloss.TRACED_FORMS, "cpu", functional_chunk_loss)  # the CPU as CUDA is
        torch._dynamo.reset()
        y = chunk(16, 512, torch.float32)[0]
        compiled(y, targets, mix, 15.0, True)
        assert torch.equal(y, chunk(16, 512, torch.float32)[0])  # traced: the functional form
    torch._dynamo.reset()  # that trace does not outlive the patch
    in_place_calls = []
    monkeypatch.setattr(headloss, "chunk_loss", lambda *args: in_place_calls.append(1) or chunk_loss(*args))
    with torch.compiler.set_stance("force_eager"):
        compiled(y, targets, mix, 15.0, True)
    assert in_place_calls == [1]


@pytest.mark.parametrize("k", [1, 3], ids=["next_token", "mtp"])
def test_compiled_functional_form_keeps_no_float32_logits_for_cuda(k):
    """What the functional form compiles to under a CUDA device's realize rules (inductor asks ir.is_cpu only to
    realise more on CPU): the bf16 gradient is the only (rows, V) buffer, and the loss math is two loops over the
    chunk, the row sums and the gradient, with --mtp's three targets a row as with one. (The in-place form
    materialises a float32 chunk and writes into its input: ~6x the bytes a chunk, BENCHMARKS.md.)"""
    from torch._inductor import config, ir
    from torch._inductor.utils import run_and_get_code

    y, targets, mix = chunk(64, 512, torch.bfloat16, k)
    compiled = torch.compile(functional_chunk_loss, fullgraph=True, dynamic=False)
    with config.patch(fx_graph_cache=False), mock.patch.object(ir, "is_cpu", lambda node: False):
        code = run_and_get_code(compiled, y, targets, mix, 15.0, True)[1][-1]
    assert re.findall(r"empty_strided_cpu\(\(64, 512\), \(512, 1\), torch\.(\w+)\)", code) == ["bfloat16"]
    assert len(re.findall(r"for\(.*<static_cast<int64_t>\((512|32768)L\)", code)) == 2


# ---- multi-token prediction (--mtp) ----

MTP = torch.tensor([1.0, 0.5, 0.25])  # --mtp's weights at the start


def windows_inputs(dtype=torch.float64):
    """3 windows of 7 tokens (21 rows: chunks of 8 make a ragged last one of 5), width 6, vocabulary 11, logits past
    the caps; one target ignored mid-window, so the positions before it lose their second or third target too."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 6, dtype=dtype, generator=gen, requires_grad=True)
    weight = (3 * torch.randn(11, 6, dtype=dtype, generator=gen)).requires_grad_()
    targets = torch.randint(0, 11, (3, 7), generator=gen)
    targets[1, 3] = -100
    return x, weight, targets


def weighted_cross_entropies(x, weight, targets, cap, mtp_weights):
    """The reference: full logits, one cross-entropy per target j places ahead within its window (none past the
    window's end), their weighted sum, over the counted next-token targets."""
    logits = cap * torch.tanh(x @ weight.T / cap) if cap else x @ weight.T
    B, T = targets.shape
    total = 0.0
    for j, w in enumerate(mtp_weights.tolist()):
        ahead = torch.full_like(targets, -100)
        ahead[:, : T - j] = targets[:, j:]
        total = total + w * F.cross_entropy(logits, ahead.reshape(-1), reduction="sum")
    return total / (targets != -100).sum()


@pytest.mark.parametrize("chunk_fn", [chunk_loss, functional_chunk_loss], ids=["in_place", "functional"])
@pytest.mark.parametrize("cap", CAPS)
def test_mtp_loss_and_gradient_equal_the_weighted_sum_of_cross_entropies(cap, chunk_fn):
    x, weight, targets = windows_inputs()
    loss = head_loss(x, weight, targets, cap, rows=8, chunk_fn=chunk_fn, mtp_weights=MTP)
    reference = weighted_cross_entropies(x, weight, targets, cap, MTP)
    assert torch.allclose(loss, reference, rtol=1e-12)
    grads, ref_grads = torch.autograd.grad(loss, (x, weight)), torch.autograd.grad(reference, (x, weight))
    assert all(torch.allclose(g, r, rtol=1e-10, atol=1e-14) for g, r in zip(grads, ref_grads))
    # targets taken across windows (the flat sequence shifted) would score other tokens
    flat = weighted_cross_entropies(x, weight, targets.reshape(1, -1), cap, MTP)
    assert not torch.allclose(loss, flat, rtol=1e-6)


@pytest.mark.parametrize("cap", [0.0, 15.0])
def test_mtp_head_loss_gradcheck(cap):
    x, weight, targets = windows_inputs()
    assert torch.autograd.gradcheck(lambda x, w: head_loss(x, w, targets, cap, rows=8, mtp_weights=MTP), (x, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_fn", [chunk_loss, functional_chunk_loss], ids=["in_place", "functional"])
@pytest.mark.parametrize("cap", CAPS)
def test_mtp_weights_one_zero_zero_equal_the_next_token_loss_exactly(cap, chunk_fn, dtype):
    x, weight, targets = head_inputs()  # 40 rows as 4 windows of 10; chunks of 16, a ragged last one
    windows = targets.view(4, 10)
    plain = loss_and_grads(x, weight, windows, cap, dtype, chunk_fn=chunk_fn)
    mtp = loss_and_grads(x, weight, windows, cap, dtype, chunk_fn=chunk_fn, mtp_weights=torch.tensor([1.0, 0, 0]))
    assert all(torch.equal(a, b) for a, b in zip(mtp, plain))
    assert torch.equal(plain[0], loss_and_grads(x, weight, targets, cap, dtype, chunk_fn=chunk_fn)[0])


@pytest.mark.parametrize("form", ["in_place", "functional"])
def test_mtp_weights_are_data_compiled_once_and_never_again(form, monkeypatch, request):
    """The chunk function compiled once per chunk shape at the first weights; every later schedule point reuses those
    graphs (no recompile: the stance fails on one) and matches the eager loss."""
    request.addfinalizer(torch._dynamo.reset)  # before the patch is undone: no trace outlives it
    if form == "functional":
        monkeypatch.setitem(headloss.TRACED_FORMS, "cpu", functional_chunk_loss)
    torch._dynamo.reset()
    loss_fn = compiled_head_loss()
    x, weight, targets = windows_inputs(torch.float32)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i, progress in enumerate([0.0, 1 / 24, 0.1, 0.5]):
        weights = torch.tensor(train.mtp_weights(progress))
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            loss = loss_fn(x, weight, targets, 15.0, rows=8, mtp_weights=weights)
        eager = head_loss(x, weight, targets, 15.0, rows=8, mtp_weights=weights)
        assert torch.allclose(loss, eager, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 2  # chunks of 8 rows and of 5


def test_mtp_weight_schedule_at_the_records_breakpoints():
    """mnGPT (train_gpt_medium.py, x = step / (scheduled steps / 4)): [1, 0.5, 0.25 (1 - 3x)] below x = 1/3,
    [1, 0.5 (2 - 3x)] below 2/3, then [1]; here three weights always, the faded ones 0."""
    expected = {
        0.0: [1.0, 0.5, 0.25],
        1 / 24: [1.0, 0.5, 0.125],
        1 / 12: [1.0, 0.5, 0.0],
        1 / 8: [1.0, 0.25, 0.0],
        1 / 6: [1.0, 0.0, 0.0],
        0.5: [1.0, 0.0, 0.0],
        1.0: [1.0, 0.0, 0.0],
    }
    for progress, weights in expected.items():
        assert train.mtp_weights(progress) == pytest.approx(weights, abs=1e-12), progress


def test_the_step_loss_fn_carries_the_weights_with_mtp_and_is_the_runs_without():
    run = SimpleNamespace(hp=SimpleNamespace(mtp=False), loss_fn=head_loss, device=torch.device("cpu"))
    assert train.step_loss_fn(run, 0.0) is head_loss
    run.hp.mtp = True
    loss_fn = train.step_loss_fn(run, 1 / 24)
    assert loss_fn.func is head_loss and loss_fn.keywords["mtp_weights"].tolist() == [1.0, 0.5, 0.125]


def test_the_model_hands_its_windows_to_the_loss_and_scores_plain_next_token_loss_without_it():
    """model.forward passes targets as (B, T) windows, so the extra targets stop at each window's end; its own
    forward (what the organizers run) and a loss_fn without weights stay next-token cross-entropy."""
    torch.manual_seed(0)
    model = get_model({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "seq_len": 16})
    idx, targets = torch.randint(0, 128, (2, 2, 16))
    with torch.no_grad():
        logits, plain = model(idx, targets)
        mtp = model(idx, targets, loss_fn=functools.partial(head_loss, mtp_weights=MTP))[1]
        next_token = model(idx, targets, loss_fn=head_loss)[1]
    vocab = logits.size(-1)
    reference = weighted_cross_entropies(logits.view(-1, vocab), torch.eye(vocab), targets, 0.0, MTP)
    assert abs(mtp.item() - reference.item()) < 1e-4 and abs(next_token.item() - plain.item()) < 1e-5


@pytest.mark.slow
def test_train_py_with_mtp_compiles_the_planned_graphs_once_and_validates_next_token_loss(tmp_path, token_dir):
    """train.py --mtp, compiled, a recompile an error: the first step's loss carries the extra targets (weights
    [1, 0.5, 0] at its progress of 1/12: ~1.5x the next-token loss ln(V) at init), the weights fade to next-token by
    step 2 and change every step before, yet the planned graphs compile once and nothing runs eagerly; validation
    scores next-token loss."""
    args = [*on_tokens(token_dir), *TINY, "--mtp", "--compile", "--on_recompile", "fail", "--max_steps", "12"]
    args += [*LONG_BUDGET, "--log_every_s", "0", "--save_every_min", "0", "--progress_by", "steps"]
    proc = subprocess.run(command(args, 1), cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    rows, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    first, second = rows[0]["train_loss"], rows[1]["train_loss"]
    assert 1.4 * math.log(VOCAB) < first < 1.6 * math.log(VOCAB) and second < 1.05 * math.log(VOCAB)
    assert summary["compiled_graphs"] == summary["planned_graphs"] and summary["eager_runs"] == 0
    assert summary["val_loss"] < 1.05 * math.log(VOCAB)

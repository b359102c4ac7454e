"""headloss.py's two forms of the chunk loss math, the in-place one (eager, and compiled on CPU) and the functional
one (compiled on CUDA), which must agree: the same row losses, and gradients within bf16 rounding."""

import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import headloss  # noqa: E402
from headloss import chunk_loss, compiled_head_loss, functional_chunk_loss, head_loss  # noqa: E402
from model import get_model  # noqa: E402

CAPS = [0.0, 15.0, 2.5, 30.0]  # uncapped, the default, and any finite cap >= 0 the model allows
DTYPES = [torch.float32, torch.bfloat16]


def chunk(rows, vocab, dtype, seed=0):
    """A chunk as HeadLoss hands it over: the matmul's output (spread past the caps), targets (rows, 1) and their
    mix (1 where a target counts, 0 where it is ignored: the second row's)."""
    gen = torch.Generator().manual_seed(seed)
    y = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (rows, 1), generator=gen)
    mix = torch.ones(rows, 1)
    mix[1] = 0
    return y, targets, mix


def assert_g_close(g, reference, total):
    """Gradients within bf16 rounding: one unit in the last place of the reference (2^-7 of it: both forms round a
    float32 value to bf16's 8 significant bits, and two float32 values a hair apart can round to neighbours), plus
    the float32 difference of the row sum, which only the target column (e - total) carries (1e-6 of the total).
    In float32 the first term is far looser than needed; the second bounds the summation order."""
    assert g.dtype == reference.dtype
    bound = 2**-7 * reference.float().abs() + 1e-6 * total
    assert ((g.float() - reference.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("cap", CAPS)
def test_functional_chunk_loss_equals_the_in_place_one(cap, dtype):
    y, targets, mix = chunk(24, 512, dtype)
    loss, total, g = functional_chunk_loss(y, targets, mix, cap, True)
    ref_loss, ref_total, ref_g = chunk_loss(y.clone(), targets, mix, cap, True)
    assert loss.dtype == torch.float32 and g.dtype == dtype  # upcast inside, g back in the matmul's dtype
    assert (loss - ref_loss).abs().max() < 1e-5 and torch.allclose(total, ref_total, rtol=1e-6)
    assert_g_close(g, ref_g, ref_total)
    assert functional_chunk_loss(y, targets, mix, cap, False)[2] is None
    assert torch.equal(y, chunk(24, 512, dtype)[0])  # its input untouched: nothing in place


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


def test_compiled_functional_form_keeps_no_float32_logits_for_cuda():
    """What the functional form compiles to under a CUDA device's realize rules (inductor asks ir.is_cpu only to
    realise more on CPU): the bf16 gradient is the only (rows, V) buffer, and the loss math is two loops over the
    chunk, the row sums and the gradient. (The in-place form
    materialises a float32 chunk and writes into its input: ~6x the bytes a chunk, BENCHMARKS.md.)"""
    from torch._inductor import config, ir
    from torch._inductor.utils import run_and_get_code

    y, targets, mix = chunk(64, 512, torch.bfloat16)
    compiled = torch.compile(functional_chunk_loss, fullgraph=True, dynamic=False)
    with config.patch(fx_graph_cache=False), mock.patch.object(ir, "is_cpu", lambda node: False):
        code = run_and_get_code(compiled, y, targets, mix, 15.0, True)[1][-1]
    assert re.findall(r"empty_strided_cpu\(\(64, 512\), \(512, 1\), torch\.(\w+)\)", code) == ["bfloat16"]
    assert len(re.findall(r"for\(.*<static_cast<int64_t>\((512|32768)L\)", code)) == 2


def test_the_model_hands_its_windows_to_the_loss_and_scores_plain_next_token_loss():
    """model.forward with the chunked loss (training's) and without it (what the organizers run) score the same
    next-token cross-entropy over (B, T) windows."""
    torch.manual_seed(0)
    model = get_model({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "seq_len": 16})
    idx, targets = torch.randint(0, 128, (2, 2, 16))
    with torch.no_grad():
        logits, plain = model(idx, targets)
        chunked = model(idx, targets, loss_fn=head_loss)[1]
    reference = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    assert abs(chunked.item() - plain.item()) < 1e-5 and abs(plain.item() - reference.item()) < 1e-6

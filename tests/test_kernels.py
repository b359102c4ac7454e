"""The kernels chosen before the clock (kernels.py): the attention backend on every compute capability, its check
against math and the fallback, the ptxas a B300 needs; the versions line; a compile failure on any rank, named."""

import dataclasses
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
import launch
import ranks
import report
from conftest import LONG_BUDGET, ROOT, TINY, child_env, command, on_tokens, read_metrics

CPU = torch.device("cpu")
CALL = kernels.AttentionCall(batch=2, seq_len=64, n_head=8, head_dim=128, device=CPU)  # the event's heads, shorter
ORDER = ("cudnn", "flash", "efficient", "math")
CUDNN_OK, CUDNN_OLD = 91501, 91002  # above torch's own rule for preferring cuDNN attention (9.15.0), and below it


def sdp_state():
    """Every global SDPA setting a choice can change: the priority order and each backend's switch."""
    cuda = torch.backends.cuda
    enabled = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    return torch._C._get_sdp_priority_order(), (*enabled, cuda.math_sdp_enabled())


@pytest.fixture
def backends(monkeypatch):
    """Backends made to run on CPU as a GPU's would (the math kernel's results), or to fail: {name: "error" or
    "wrong"} sets how a backend misbehaves."""
    real, behaviour = kernels.sdpa_with_grads, {}

    def run(backend, q, k, v, grad, compiled=False):
        name = {b: n for n, b in kernels.ATTENTION_BACKENDS.items()}[backend]
        if behaviour.get(name) == "error":
            raise RuntimeError(f"{name} kernel: no plan for this shape.\nmore detail")
        got = real(SDPBackend.MATH, q, k, v, grad)
        return tuple(t * 1.1 for t in got) if behaviour.get(name) == "wrong" else got

    monkeypatch.setattr(kernels, "sdpa_with_grads", run)
    return behaviour


class FlashFailsStrided(TorchDispatchMode):
    """The CPU flash kernel, forward and backward, failing on q, k, v laid out as training lays them out (transposed
    views), as a kernel whose bug depends on strides would; contiguous ones run. Records what each call received."""

    def __init__(self, fail=True):
        super().__init__()
        self.fail, self.seen = fail, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_scaled_dot_product_flash_attention_for_cpu" in str(func):
            q = args[0] if "backward" not in str(func) else args[1]
            self.seen.append((str(func), tuple(q.shape), q.stride()))
            if self.fail and not q.is_contiguous():
                raise RuntimeError("flash kernel: no plan for these strides")
        return func(*args, **(kwargs or {}))


def test_auto_puts_cudnn_first_on_capability_10_where_torchs_own_rule_would(backends):
    for capability in ((10, 3), (10, 0)):
        choice = kernels.choose_attention("auto", CALL, capability, CUDNN_OK)
        assert choice.backends == ORDER and choice.ordered and choice.name == "cudnn" and choice.op == "flash"  # CPU's
        assert choice.label == "cudnn (first of cudnn > flash > efficient > math; checked against math)"
        rule, timed = choice.notes
        assert rule == "attention: cuDNN 9.15.1 is above 9.15.0, where torch's own rule prefers cuDNN: first"
        assert timed.startswith(
            "attention: checked cudnn at the training call (2 x 64 x 8 x 128 (B, T, H, D) bfloat16, eager) against "
            "math in "
        )


@pytest.mark.parametrize("cudnn", [CUDNN_OLD, 91500, None])
def test_auto_leaves_cudnn_out_at_or_below_cudnn_9_15_0_and_says_so(backends, cudnn):
    choice = kernels.choose_attention("auto", CALL, (10, 3), cudnn)
    assert choice.backends == ("flash", "efficient", "math") and choice.name == "flash"
    assert choice.notes[0].startswith(f"attention: cuDNN {kernels.cudnn_release(cudnn)} is not above 9.15.0, below")
    assert choice.notes[0].endswith("ragged last tile: --seq_len 64): cudnn left out, --attention cudnn forces it")
    assert kernels.cudnn_release(CUDNN_OLD) == "9.10.2" and kernels.cudnn_release(None) == "none"


def test_an_older_cudnn_9_comes_first_where_the_sequence_is_whole_128_row_tiles(backends):
    """The memory-safety bug below 9.15.1 needs a ragged last tile; at the event's seq_len 1024 cuDNN (~2x flash on
    Blackwell) still comes first, checked at the training call, and the line says by which rule."""
    whole = dataclasses.replace(CALL, seq_len=128)
    choice = kernels.choose_attention("auto", whole, (10, 3), CUDNN_OLD)
    assert choice.backends == ORDER and choice.name == "cudnn"
    assert choice.notes[0].startswith("attention: cuDNN 9.10.2 is not above 9.15.0 (torch's own rule would not prefer")
    assert "--seq_len 128 is whole 128-row tiles" in choice.notes[0]
    assert kernels.choose_attention("auto", whole, (10, 3), 8907).backends == ORDER[1:]  # cuDNN 8: never


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), None])
def test_auto_keeps_torchs_pick_elsewhere_and_names_it(backends, capability):
    choice = kernels.choose_attention("auto", CALL, capability, CUDNN_OK)
    assert choice.backends == () and choice.name == choice.op == "flash" and choice.label == "flash (torch's pick)"


def test_a_backend_that_errors_or_disagrees_with_math_is_passed_over_and_said(backends):
    backends.update(cudnn="error", flash="wrong")
    choice = kernels.choose_attention("auto", CALL, (10, 3), CUDNN_OK)
    assert choice.backends == ("efficient", "math") and choice.ordered and choice.name == "efficient"
    _, cudnn, flash, timed = choice.notes
    assert cudnn == (
        "attention: cudnn fails its check (it does not run here: cudnn kernel: no plan for this shape); "
        "trying the next backend"
    )
    assert "flash fails its check (it disagrees with the math backend: relative error 0.1 > 0.02)" in flash
    assert "checked cudnn, flash, efficient at the training call" in timed
    backends.update(efficient="wrong")
    assert kernels.choose_attention("auto", CALL, (10, 3), CUDNN_OK).backends == ("math",)


def test_the_check_runs_the_real_kernels_on_cpu_flash_passes_and_cudnn_cannot_run():
    choice = kernels.choose_attention("auto", CALL, (10, 3), CUDNN_OK)
    assert choice.backends == ("flash", "efficient", "math") and choice.op == "flash"
    assert choice.notes[1].startswith("attention: cudnn fails its check (it does not run here: No viable backend")
    q, k, v, grad = CALL.tensors()
    error = kernels.attention_error(SDPBackend.FLASH_ATTENTION, q, k, v, grad)
    assert 1e-3 < error < kernels.ATTENTION_TOLERANCE / 2  # bf16 rounding, well inside the tolerance


def test_the_check_gives_sdpa_the_training_layout_and_batch_and_passes_over_a_backend_that_fails_only_there():
    call = kernels.AttentionCall(batch=3, seq_len=16, n_head=2, head_dim=8, device=CPU)
    with FlashFailsStrided(fail=False) as mode:
        kernels.choose_attention("flash", call, None)
    # what model.Attention gives SDPA: (B, H, T, D) transposes of (B, T, H, D) tensors, at the plan's micro-batch
    assert {(shape, stride) for _, shape, stride in mode.seen} == {((3, 2, 16, 8), (16 * 2 * 8, 8, 2 * 8, 1))}
    assert len(mode.seen) == 2  # forward and backward
    with FlashFailsStrided():
        choice = kernels.choose_attention("auto", call, (10, 3), CUDNN_OK)
        with pytest.raises(ValueError, match=r"^--attention flash fails its check .*flash kernel: no plan for these"):
            kernels.choose_attention("flash", call, None)
    assert choice.backends == ("math",)  # flash failed at the training layout; efficient has no CPU kernel
    assert choice.notes[2] == (
        "attention: flash fails its check (it does not run here: flash kernel: no plan for these strides); trying "
        "the next backend"
    )


@pytest.mark.slow
def test_a_compiled_run_checks_the_compiled_call_and_keeps_no_graph_of_it(monkeypatch):
    """The check compiles as training does: a failure inductor alone makes (its lowering of the op) fails it, and the
    check's graphs are not counted as the run's (report.compiled_graphs)."""
    from torch._inductor import lowering

    call = kernels.AttentionCall(batch=2, seq_len=16, n_head=2, head_dim=8, device=CPU, compiled=True)
    before = report.compiled_graphs()
    choice = kernels.choose_attention("flash", call, None)
    assert choice.op == "flash" and "eager" not in choice.notes[0] and "compiled) against math" in choice.notes[0]
    assert report.compiled_graphs() == before

    def cannot_lower(*args, **kwargs):
        raise RuntimeError("flash attention: no lowering for this layout")

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    monkeypatch.setitem(lowering.lowerings, op, cannot_lower)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # a cached graph would skip the lowering
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    with pytest.raises(ValueError, match="flash attention: no lowering for this layout"):
        kernels.choose_attention("flash", call, None)
    kernels.choose_attention("flash", dataclasses.replace(call, compiled=False), None)  # eager still runs
    assert report.compiled_graphs() == before


def test_without_set_priority_auto_says_torchs_pick_and_changes_nothing(backends, monkeypatch):
    assert kernels.has_set_priority()  # this torch has it
    monkeypatch.setattr(kernels, "has_set_priority", lambda: False)
    choice = kernels.choose_attention("auto", CALL, (10, 3), CUDNN_OK)
    assert choice.backends == () and choice.name == "flash"
    assert choice.label == "flash (torch's pick: this torch's sdpa_kernel cannot set a priority)"
    forced = kernels.choose_attention("efficient", CALL, (10, 3), CUDNN_OK)
    assert forced.backends == ("efficient",) and not forced.ordered  # a forced one is still restricted to


def test_a_forced_backend_is_checked_and_one_that_fails_is_one_sentence(backends):
    choice = kernels.choose_attention("cudnn", CALL, (9, 0), CUDNN_OLD)  # forced: whatever torch's own rule says
    assert (
        choice.backends == ("cudnn",) and not choice.ordered and choice.label == "cudnn (forced, checked against math)"
    )
    backends.update(cudnn="error", flash="wrong")
    with pytest.raises(ValueError, match=r"^--attention cudnn fails its check at this run's training call \(it does"):
        kernels.choose_attention("cudnn", CALL, (9, 0))
    with pytest.raises(ValueError, match=r"disagrees with the math backend: relative error 0\.1 > 0\.02\); force"):
        kernels.choose_attention("flash", CALL, None)


def test_the_choice_is_active_only_inside_its_context():
    before = sdp_state()
    with kernels.priority_choice(ORDER).active():
        order, enabled = sdp_state()
        assert order[:4] == [int(kernels.ATTENTION_BACKENDS[name]) for name in ORDER] and all(enabled)
    assert sdp_state() == before
    with kernels.AttentionChoice("math", "math (forced)", ("math",)).active():
        assert sdp_state()[1] == (False, False, False, True)
    with kernels.AttentionChoice("flash", "flash (torch's pick)").active():
        assert sdp_state() == before
    assert sdp_state() == before


def test_a_switch_after_step_0_holds_until_the_runs_context_ends():
    before = sdp_state()
    with kernels.priority_choice(ORDER, call=CALL).active():
        rest = kernels.next_attention(kernels.priority_choice(ORDER[1:], call=CALL))
        assert rest.backends == ("math",) and rest.op == "math"  # efficient has no CPU kernel: its check fails
        assert rest.notes[0].startswith("attention: efficient fails its check (it does not run here")
        assert kernels.switch_attention(rest) is rest and sdp_state()[1] == (False, False, False, True)
        assert kernels.next_attention(rest) is None  # nothing after math
    assert sdp_state() == before


def test_only_an_attention_failure_moves_step_0_down_the_backends():
    try:
        raise RuntimeError("cuDNN Frontend error: No execution plans support the graph")
    except RuntimeError as inner:
        try:
            raise RuntimeError("backend='inductor' raised:") from inner
        except RuntimeError as outer:
            assert kernels.failed_in_attention(outer)
    for text in ("CppCompileError: C++ compile error", "PTXASError: ptxas fatal: sm_103a", "out of memory"):
        assert not kernels.failed_in_attention(RuntimeError(text))
    assert not kernels.failed_in_attention(RuntimeError("triton kernel for _scaled_dot_product_cudnn_attention"))


def test_a_graph_compiled_under_the_choice_bakes_in_its_kernel():
    """Why the choice must hold when step 0 traces: the compiled graph calls the kernel the context allowed then."""
    sys.path.insert(0, str(ROOT / "bench"))
    import attention_backends

    q, k, v = torch.randn(3, 1, 32, 2, 16, dtype=torch.bfloat16).unbind(0)
    before = sdp_state()
    flash = attention_backends.compiled_ops(kernels.AttentionChoice("flash", "flash (torch's pick)"), q, k, v)
    assert flash == "aten._scaled_dot_product_flash_attention_for_cpu.default"
    math = attention_backends.compiled_ops(kernels.AttentionChoice("math", "math (forced)", ("math",)), q, k, v)
    assert math == "none (math, decomposed into matmuls)" and sdp_state() == before


def test_ranks_agree_on_the_backend_furthest_down_the_list(monkeypatch):
    choice = kernels.priority_choice(ORDER)
    other_rank = types.SimpleNamespace(ReduceOp=types.SimpleNamespace(MAX="max"), all_reduce=lambda t, op: t.fill_(2))
    monkeypatch.setattr(kernels, "dist", other_rank)
    agreed = kernels.agreed_attention(choice, CPU, world=2)
    assert agreed.backends == ("efficient", "math") and agreed.name == "efficient"
    assert agreed.notes == ("attention: another rank's check failed down to efficient; every rank uses it",)
    same = types.SimpleNamespace(ReduceOp=other_rank.ReduceOp, all_reduce=lambda t, op: t)
    monkeypatch.setattr(kernels, "dist", same)
    assert kernels.agreed_attention(choice, CPU, world=2) is choice
    default = kernels.AttentionChoice("flash", "flash (torch's pick)")
    assert kernels.agreed_attention(default, CPU, world=2) is default  # still one all-reduce: no rank left waiting


# ----------------------------------------------------------------------------- the ptxas a B300 needs


def fake_ptxas(folder, says):
    """An executable `ptxas` in folder/bin that prints `says` for --version."""
    path = folder / "bin" / "ptxas"
    path.parent.mkdir(parents=True)
    path.write_text(f"#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


def release_line(version):
    return f"Cuda compilation tools, release {version}, V{version}.88"


@pytest.fixture
def machine(tmp_path):
    """CUDA_HOME with a 12.8 ptxas, /usr/local-like cuda-12.9 and cuda-13.0 folders, a PATH ptxas that says garbage."""
    home = fake_ptxas(tmp_path / "home", release_line("12.8"))
    old, new = (fake_ptxas(tmp_path / f"local/cuda-{v}", release_line(v)) for v in ("12.9", "13.0"))
    garbage = fake_ptxas(tmp_path / "tools", "ptxas: something else entirely")
    env = {"CUDA_HOME": str(tmp_path / "home"), "PATH": str(tmp_path / "tools" / "bin")}
    return types.SimpleNamespace(
        env=env, glob=str(tmp_path / "local" / "cuda*"), home=home, old=old, new=new, garbage=garbage
    )


def test_ptxas_version_reads_the_release_or_nothing(machine, tmp_path):
    assert kernels.ptxas_version(machine.home) == (12, 8) and kernels.ptxas_version(machine.new) == (13, 0)
    assert kernels.ptxas_version(machine.garbage) is None and kernels.ptxas_version(str(tmp_path / "none")) is None
    assert kernels.ptxas_candidates(machine.env, machine.glob) == [
        machine.home,
        machine.new,
        machine.old,
        machine.garbage,
    ]


def test_a_b300_with_an_old_triton_is_pointed_at_cuda_12_9s_ptxas_as_triton_itself_would(machine):
    env = dict(machine.env)
    said = kernels.point_triton_at_ptxas((10, 3), "3.5.1", env, machine.glob)
    assert env["TRITON_PTXAS_PATH"] == machine.old  # CUDA_HOME's 12.8 is too old; 13.0 is looked at first, 12.9 wins
    assert said == (
        f"toolchain: Triton 3.5.1's own ptxas cannot assemble for sm_103; compiling with {machine.old} (CUDA 12.9, "
        f"the one Triton itself pins for sm_100/sm_103) through TRITON_PTXAS_PATH"
    )
    env = {"PATH": f"{machine.env['PATH']}:{os.path.dirname(machine.old)}"}
    assert "CUDA 12.9" in kernels.point_triton_at_ptxas((10, 3), "3.4.0", env, "/nowhere*")
    assert env["TRITON_PTXAS_PATH"] == machine.old  # PATH's garbage skipped, its 12.9 taken


def test_without_a_cuda_12_9_the_oldest_newer_ptxas_is_taken_and_said(tmp_path):
    newest, older = (fake_ptxas(tmp_path / f"local/cuda-{v}", release_line(v)) for v in ("13.1", "13.0"))
    env = {"PATH": os.path.dirname(newest)}  # 13.1 is looked at first, on PATH and in the folders
    said = kernels.point_triton_at_ptxas((10, 3), "3.5.1", env, str(tmp_path / "local" / "cuda*"))
    assert env["TRITON_PTXAS_PATH"] == older
    assert f"compiling with {older} (CUDA 13.0, none of CUDA 12.9, which Triton itself pins" in said
    assert said.endswith("is here: it needs a CUDA 13.0+ driver) through TRITON_PTXAS_PATH")


def test_no_usable_ptxas_is_one_warning_and_nothing_set(machine):
    env = {"CUDA_HOME": machine.env["CUDA_HOME"], "PATH": machine.env["PATH"]}
    said = kernels.point_triton_at_ptxas((10, 3), "3.5.0", env, "/nowhere*")
    assert "TRITON_PTXAS_PATH" not in env and said.startswith("warning: Triton 3.5.0's own ptxas cannot assemble")
    assert "compiling will fail at step 0 and training will run eagerly" in said and "install torch>=2.10" in said


@pytest.mark.parametrize(
    "capability, triton, preset",
    [
        ((10, 3), "3.6.0", None),
        ((10, 3), "3.7.1+git5d6048aa", None),
        ((10, 3), None, None),
        ((10, 0), "3.5.1", None),
        ((9, 0), "3.5.1", None),
        ((10, 3), "3.5.1", "/opt/mine/ptxas"),
    ],
)
def test_nothing_to_do_leaves_the_environment_alone(machine, capability, triton, preset):
    env = {**machine.env, **({"TRITON_PTXAS_PATH": preset} if preset else {})}
    before = dict(env)
    assert kernels.point_triton_at_ptxas(capability, triton, env, machine.glob) is None and env == before


def test_inductors_compile_workers_are_the_cpus_per_rank_unless_the_user_set_them():
    env = {"LOCAL_WORLD_SIZE": "8"}
    said = ranks.cap_compile_workers(env, compiling=True, cpus=240)
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "30"
    assert said == "compile: 30 inductor compile worker(s) per rank (240 CPUs visible / 8 rank(s) on this node)"
    for env, cpus, workers in (({}, 240, "32"), ({"LOCAL_WORLD_SIZE": "8"}, 4, "1"), ({}, 2, "2")):
        ranks.cap_compile_workers(env, compiling=True, cpus=cpus)
        assert env["TORCHINDUCTOR_COMPILE_THREADS"] == workers  # inductor's own cap, at least one
    mine = {"TORCHINDUCTOR_COMPILE_THREADS": "4", "LOCAL_WORLD_SIZE": "8"}
    assert (
        ranks.cap_compile_workers(mine, compiling=True, cpus=240) is None
        and mine["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    )
    assert ranks.cap_compile_workers({}, compiling=False, cpus=240) is None


def test_tf32_is_set_so_that_torchs_legacy_and_new_readers_agree(monkeypatch):
    """The form set must leave both of torch's TF32 states consistent: the new one alone makes every later reader of
    the legacy one (inductor's among them) raise "mix of the legacy and new APIs"."""
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            launch.allow_tf32_matmuls()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"  # raises after the new form alone
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    assert before in ("none", "ieee") and torch.backends.cuda.matmul.fp32_precision == "ieee"


# ----------------------------------------------------------------------------- the versions line, ranks named


def test_the_versions_line_says_the_toolchain_the_gpu_and_the_attention(monkeypatch):
    cpu = ranks.versions(CPU, "flash (torch's pick)")
    assert (
        cpu
        == f"torch {torch.__version__} | Triton {kernels.triton_version() or 'none'} | attention flash (torch's pick)"
    )
    fakes = {
        (torch.cuda, "get_device_capability"): lambda device: (10, 3),
        (torch.cuda, "get_device_name"): lambda device: "NVIDIA B300",
        (torch.cuda.nccl, "version"): lambda: (2, 27, 5),
        (torch.backends.cudnn, "version"): lambda: 91002,
        (torch.version, "cuda"): "12.9",
        (ranks.dist, "is_nccl_available"): lambda: True,
        (ranks, "triton_version"): lambda: "3.5.1",
    }
    for (owner, name), fake in fakes.items():
        monkeypatch.setattr(owner, name, fake)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/usr/local/cuda-13.0/bin/ptxas")
    assert ranks.versions(torch.device("cuda", 0), "cudnn (first of cudnn > flash)") == (
        f"torch {torch.__version__} | Triton 3.5.1 | CUDA 12.9 | cuDNN 9.10.2 | NCCL 2.27.5 | NVIDIA B300 (sm_103) | "
        f"TRITON_PTXAS_PATH /usr/local/cuda-13.0/bin/ptxas | attention cudnn (first of cudnn > flash)"
    )


def test_ranks_are_named_as_a_person_reads_them():
    assert ranks.rank_span([3]) == "rank 3" and ranks.rank_span(list(range(8, 16))) == "ranks 8-15"
    assert ranks.rank_span([0, 2, *range(8, 16), 31]) == "ranks 0, 2, 8-15, 31"
    assert ranks.failing_ranks(None, CPU, 1, 0) == ([], None)
    assert ranks.failing_ranks("why", CPU, 1, 0) == ([0], "why")


# ----------------------------------------------------------------------------- through train.py

RECORDER = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import torch, train
seen = []
def recording(function):
    def call(*args, **kwargs):
        seen.append(torch.backends.cuda.flash_sdp_enabled())
        return function(*args, **kwargs)
    return call
train.Trainer.accumulate, train.evaluate = recording(train.Trainer.accumulate), recording(train.evaluate)
train.main(sys.argv[1:])
print(json.dumps({{"during": seen, "after": torch.backends.cuda.flash_sdp_enabled()}}))
"""


def test_a_forced_backend_holds_for_training_and_validation_and_one_that_cannot_run_is_refused(tmp_path, token_dir):
    args = [*on_tokens(token_dir), *TINY, "--max_steps", "3", *LONG_BUDGET, "--log_every_s", "0"]
    proc = subprocess.run(
        [sys.executable, "-c", RECORDER, *args, "--attention", "math"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["during"]) >= 4 and not any(seen["during"]) and seen["after"]  # flash off inside only
    assert "| attention math (forced, checked against math)" in proc.stdout
    assert read_metrics(tmp_path / "metrics.jsonl")[2]["attention"] == "math"
    refused = tmp_path / "refused"
    refused.mkdir()
    proc = subprocess.run(
        command([*args, "--attention", "cudnn"], 1),
        cwd=refused,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --attention cudnn fails its check at this run's training call (it does not run here: No viable backend "
        "for scaled_dot_product_attention was found); force another backend or leave --attention auto"
    ]
    assert not list(refused.iterdir())  # nothing written


CHECK_RECORDER = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
import train
from torch.utils._python_dispatch import TorchDispatchMode

class Flash(TorchDispatchMode):  # records what the CPU flash kernel gets; fails it on strided inputs if asked
    seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "_scaled_dot_product_flash_attention_for_cpu" in str(func):
            q = args[1] if "backward" in str(func) else args[0]
            self.seen.append([list(q.shape), list(q.stride())])
            if os.environ.get("FAIL_STRIDED") and not q.is_contiguous():
                raise RuntimeError("flash kernel: no plan for these strides")
        return func(*args, **(kwargs or {{}}))

before_the_clock = Flash()
before_the_clock.__enter__()
train_loop = train.Trainer.train
def after_the_checks(trainer):
    before_the_clock.__exit__(None, None, None)
    print(json.dumps({{"seen": Flash.seen, "micro_batch": trainer.run.plan.micro_batch}}), flush=True)
    return train_loop(trainer)
train.Trainer.train = after_the_checks
train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_the_check_before_the_clock_is_the_training_call_and_refuses_a_backend_that_fails_only_there(
    tmp_path, token_dir
):
    args = [*on_tokens(token_dir), *TINY, "--max_steps", "1", *LONG_BUDGET, "--attention", "flash"]
    script = [sys.executable, "-c", CHECK_RECORDER, *args]
    proc = subprocess.run(script, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"seen"')))
    micro, seq, heads, head_dim = said["micro_batch"], 32, 2, 32  # TINY: seq_len 32, 2 heads of 64 / 2
    assert micro == 8 and len(said["seen"]) == 2  # the check's forward and backward, at the plan's micro-batch
    assert (
        said["seen"] == [[[micro, heads, seq, head_dim], [seq * heads * head_dim, head_dim, heads * head_dim, 1]]] * 2
    )
    failing = tmp_path / "failing"
    failing.mkdir()
    env = {**child_env(), "FAIL_STRIDED": "1"}
    proc = subprocess.run(script, cwd=failing, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --attention flash fails its check at this run's training call (it does not run here: flash kernel: no "
        "plan for these strides); force another backend or leave --attention auto"
    ]
    assert not list(failing.iterdir())  # refused before anything was written, let alone the clock


RANK1_CANNOT_COMPILE = f"""
import os, sys
if os.environ["RANK"] == "1":  # this rank's compiler fails, as a full /tmp or a ptxas that does not know the GPU would
    os.environ["CXX"] = "/bin/false"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.getcwd(), "inductor_rank1")
sys.path.insert(0, {str(ROOT)!r})
import train
train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_compile_failure_on_rank_1_alone_is_named_on_rank_0_and_counted(tmp_path, token_dir):
    script = tmp_path / "rank1_cannot_compile.py"
    script.write_text(RANK1_CANNOT_COMPILE)
    args = [*on_tokens(token_dir), *TINY, "--compile", "--max_steps", "2", *LONG_BUDGET, "--log_every_s", "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(
        [*torchrun, *args], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    said = [line for line in proc.stdout.splitlines() if "compiling failed at the first step" in line]
    assert len(said) == 1 and said[0].startswith("warning: compiling failed at the first step on rank 1 of 2 (")
    assert "C++ compiler" in said[0] and said[0].endswith(
        "training goes on eagerly there, and every rank waits for them"
    )
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["compile_fallback_ranks"] == [1] and "C++ compiler" in summary["compile_fallback"]
    assert summary["steps"] == 2 and summary["compiled_graphs"] == summary["planned_graphs"]  # rank 0 compiled


STEP0_FAILS_IN_FLASH_ON_RANK_1 = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch, launch, train

choose = launch.choose_attention
def as_on_a_b300(forced, call, capability, cudnn):  # cuDNN first; on CPU its check fails and flash's passes
    return choose(forced, call, (10, 3), 91501)
launch.choose_attention = as_on_a_b300

loop, kernel = train.Trainer.train, []
def flash_fails_from_step_0_on_rank_1(trainer):  # after the checks: as a kernel whose failure they could not see
    if os.environ["RANK"] == "1":
        kernel.append(torch.library.Library("aten", "IMPL"))
        def fails(*args, **kwargs):
            raise RuntimeError("flash attention kernel failed: no kernel image is available for this layout")
        kernel[0].impl("_scaled_dot_product_flash_attention_for_cpu", fails, "CPU")
    return loop(trainer)
train.Trainer.train = flash_fails_from_step_0_on_rank_1
train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_step_0_failure_inside_attention_on_one_rank_moves_every_rank_down_the_backends_compiled(tmp_path, token_dir):
    script = tmp_path / "flash_fails_on_rank_1.py"
    script.write_text(STEP0_FAILS_IN_FLASH_ON_RANK_1)
    args = [*on_tokens(token_dir), *TINY, "--compile", "--max_steps", "2", *LONG_BUDGET, "--log_every_s", "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(
        [*torchrun, *args], cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "| attention flash (first of flash > efficient > math; checked against math), op flash" in proc.stdout
    assert "rank 1: step 0 failed inside attention flash (RuntimeError: flash attention kernel failed" in proc.stderr
    said = [line for line in proc.stdout.splitlines() if "step 0 failed inside attention" in line]
    assert len(said) == 1 and said[0].startswith("warning: step 0 failed inside attention flash on rank 1 of 2 (")
    assert said[0].endswith("every rank compiles again under math (first of math; checked against math), op math")
    assert "attention: efficient fails its check (it does not run here" in proc.stdout  # no CPU kernel: passed over
    assert "compiling failed at the first step" not in proc.stdout  # no rank went eager
    _, _, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["attention"] == summary["attention_op"] == "math" and summary["compile_fallback_ranks"] == []
    assert summary["steps"] == 2 and summary["compiled_graphs"] == summary["planned_graphs"]  # flash's forgotten

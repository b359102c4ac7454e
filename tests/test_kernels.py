"""The kernels chosen before the clock (kernels.py): the attention backend on every compute capability, its check
against math and the fallback, the ptxas a B300 needs; the versions line; a compile failure on any rank, named."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch.nn.attention import SDPBackend

import kernels
import ranks
from conftest import LONG_BUDGET, ROOT, TINY, child_env, command, on_tokens, read_metrics

CPU = torch.device("cpu")
HEADS = dict(n_head=8, head_dim=128, seq_len=64)  # the event's heads, a short sequence
ORDER = ("cudnn", "flash", "efficient", "math")


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

    def run(backend, q, k, v, grad):
        name = {b: n for n, b in kernels.ATTENTION_BACKENDS.items()}[backend]
        if behaviour.get(name) == "error":
            raise RuntimeError(f"{name} kernel: no plan for this shape.\nmore detail")
        got = real(SDPBackend.MATH, q, k, v, grad)
        return tuple(t * 1.1 for t in got) if behaviour.get(name) == "wrong" else got

    monkeypatch.setattr(kernels, "sdpa_with_grads", run)
    return behaviour


@pytest.mark.parametrize("capability", [(10, 3), (10, 0)])
def test_auto_puts_cudnn_first_on_capability_10(backends, capability):
    choice = kernels.choose_attention("auto", **HEADS, device=CPU, capability=capability)
    assert choice.backends == ORDER and choice.ordered and choice.name == "cudnn" and not choice.notes
    assert choice.label == "cudnn (first of cudnn > flash > efficient > math; checked against math)"


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), None])
def test_auto_keeps_torchs_pick_elsewhere_and_names_it(backends, capability):
    choice = kernels.choose_attention("auto", **HEADS, device=CPU, capability=capability)
    assert choice.backends == () and choice.name == "flash" and choice.label == "flash (torch's pick)"  # CPU's pick


def test_a_backend_that_errors_or_disagrees_with_math_is_passed_over_and_said(backends):
    backends.update(cudnn="error", flash="wrong")
    choice = kernels.choose_attention("auto", **HEADS, device=CPU, capability=(10, 3))
    assert choice.backends == ("efficient", "math") and choice.ordered and choice.name == "efficient"
    cudnn, flash = choice.notes
    assert cudnn == (
        "attention: cudnn fails its check (it does not run here: cudnn kernel: no plan for this shape); "
        "trying the next backend"
    )
    assert "flash fails its check (it disagrees with the math backend: relative error 0.1 > 0.02)" in flash
    backends.update(efficient="wrong")
    assert kernels.choose_attention("auto", **HEADS, device=CPU, capability=(10, 3)).backends == ("math",)


def test_the_check_runs_the_real_kernels_on_cpu_flash_passes_and_cudnn_cannot_run():
    choice = kernels.choose_attention("auto", **HEADS, device=CPU, capability=(10, 3))
    assert choice.backends == ("flash", "efficient", "math")
    assert choice.notes[0].startswith("attention: cudnn fails its check (it does not run here: No viable backend")
    q, k, v, grad = torch.randn(4, 1, 8, 64, 128, dtype=torch.bfloat16).unbind(0)
    error = kernels.attention_error(SDPBackend.FLASH_ATTENTION, q, k, v, grad)
    assert 1e-3 < error < kernels.ATTENTION_TOLERANCE / 2  # bf16 rounding, well inside the tolerance


def test_without_set_priority_auto_says_torchs_pick_and_changes_nothing(backends, monkeypatch):
    assert kernels.has_set_priority()  # this torch has it
    monkeypatch.setattr(kernels, "has_set_priority", lambda: False)
    choice = kernels.choose_attention("auto", **HEADS, device=CPU, capability=(10, 3))
    assert choice.backends == () and choice.name == "flash"
    assert choice.label == "flash (torch's pick: this torch's sdpa_kernel cannot set a priority)"
    forced = kernels.choose_attention("efficient", **HEADS, device=CPU, capability=(10, 3))
    assert forced.backends == ("efficient",) and not forced.ordered  # a forced one is still restricted to


def test_a_forced_backend_is_checked_and_one_that_fails_is_one_sentence(backends):
    choice = kernels.choose_attention("cudnn", **HEADS, device=CPU, capability=(9, 0))
    assert (
        choice.backends == ("cudnn",) and not choice.ordered and choice.label == "cudnn (forced, checked against math)"
    )
    backends.update(cudnn="error", flash="wrong")
    with pytest.raises(ValueError, match=r"^--attention cudnn fails its check at this run's head shape \(it does not"):
        kernels.choose_attention("cudnn", **HEADS, device=CPU, capability=(9, 0))
    with pytest.raises(ValueError, match=r"disagrees with the math backend: relative error 0\.1 > 0\.02\); force"):
        kernels.choose_attention("flash", **HEADS, device=CPU, capability=None)


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


def test_a_graph_compiled_under_the_choice_bakes_in_its_kernel():
    """Why the choice must hold when step 0 traces: the compiled graph calls the kernel the context allowed then."""
    sys.path.insert(0, str(ROOT / "bench"))
    import attention_backends

    q, k, v = torch.randn(3, 1, 2, 32, 16, dtype=torch.bfloat16).unbind(0)
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


def test_a_b300_with_an_old_triton_is_pointed_at_the_first_cuda_12_9_ptxas(machine):
    env = dict(machine.env)
    said = kernels.point_triton_at_ptxas((10, 3), "3.5.1", env, machine.glob)
    assert env["TRITON_PTXAS_PATH"] == machine.new  # CUDA_HOME's 12.8 is too old; the newest folder comes next
    assert said == (
        f"toolchain: Triton 3.5.1's own ptxas cannot assemble for sm_103; compiling with {machine.new} (CUDA 13.0) "
        f"through TRITON_PTXAS_PATH"
    )
    env = {"PATH": f"{machine.env['PATH']}:{os.path.dirname(machine.old)}"}
    assert "CUDA 12.9" in kernels.point_triton_at_ptxas((10, 3), "3.4.0", env, "/nowhere*")
    assert env["TRITON_PTXAS_PATH"] == machine.old  # PATH's garbage skipped, its 12.9 taken


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
train.accumulate, train.evaluate = recording(train.accumulate), recording(train.evaluate)
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
        "error: --attention cudnn fails its check at this run's head shape (it does not run here: No viable backend "
        "for scaled_dot_product_attention was found); force another backend or leave --attention auto"
    ]
    assert not list(refused.iterdir())  # nothing written


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

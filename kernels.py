"""The kernels a run's compute goes through, chosen before the clock: the attention backend of
F.scaled_dot_product_attention, checked against the math backend at the run's head shape, and on a B300 the ptxas
Triton assembles with. launch.py calls these; the versions line and the summary row say what was chosen.

Why: torch 2.9-2.10 prefer cuDNN attention only on compute capability 9.0 and 10.0 (sdp_utils.cpp,
check_prefer_cudnn_attention), so a B300 (10.3) runs the in-tree FlashAttention-2, about half cuDNN's speed on
Blackwell; and a Triton older than 3.6 bundles a ptxas (CUDA 12.8 or older) that cannot assemble sm_103a, so every
compile fails and the run falls back to eager (1.5-3x slower).
"""

import contextlib
import dataclasses
import glob
import inspect
import os
import re
import subprocess

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# --attention's names, in the order auto tries them on compute capability 10.x
ATTENTION_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# the largest relative error (Frobenius norm) of a backend's output and input gradients against the math backend in
# float32: bf16's own rounding gives 1.7e-3 (math) to 3.6e-3 (flash) at the event's head shape (bench/
# attention_backends.py on CPU, BENCHMARKS.md), a wrong kernel O(1)
ATTENTION_TOLERANCE = 2e-2
B300 = (10, 3)  # compute capability of Blackwell Ultra: ptxas knows sm_103a from CUDA 12.9 on
PTXAS_FOR_B300 = (12, 9)
TRITON_FOR_B300 = (3, 6)  # the first Triton to bundle a ptxas for it (ptxas-blackwell, CUDA 12.9); torch 2.10 pins it


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """What attention runs: `name` (the summary's "attention"), `label` (the versions line's), and how it is applied."""

    name: str
    label: str
    backends: tuple = ()  # --attention names enabled, first preferred; () leaves torch's default alone
    ordered: bool = False  # backends are a priority order (sdpa_kernel's set_priority), not only the ones allowed
    notes: tuple = ()  # lines to say: a backend that failed its check, and why

    def active(self):
        """The context training and validation run in (it must hold when step 0 traces the compiled blocks)."""
        if not self.backends:
            return contextlib.nullcontext()
        chosen = [ATTENTION_BACKENDS[name] for name in self.backends]
        return sdpa_kernel(chosen, set_priority=True) if self.ordered else sdpa_kernel(chosen)


def choose_attention(forced, n_head, head_dim, seq_len, device, capability, dtype=torch.bfloat16):
    """The attention backend of a run (--attention `forced`, or "auto") on `device` of compute `capability` (None on
    CPU). Auto keeps torch's pick, except on compute capability 10.x where torch's sdpa_kernel can set a priority:
    cuDNN first, then down the list to the first backend whose check passes. A forced backend that fails its check
    is a ValueError. dtype: the run's attention inputs' (bf16 under autocast)."""
    if forced != "auto":
        if problem := attention_problem(forced, n_head, head_dim, seq_len, device, dtype):
            raise ValueError(
                f"--attention {forced} fails its check at this run's head shape ({problem}); force another backend "
                f"or leave --attention auto"
            )
        return AttentionChoice(forced, f"{forced} (forced, checked against math)", (forced,))
    default = default_attention(n_head, head_dim, seq_len, device, dtype)
    if capability is None or capability[0] != 10:
        return AttentionChoice(default, f"{default} (torch's pick)")
    if not has_set_priority():
        return AttentionChoice(default, f"{default} (torch's pick: this torch's sdpa_kernel cannot set a priority)")
    names, notes = list(ATTENTION_BACKENDS), []
    for i, name in enumerate(names[:-1]):  # math is the reference: the floor, unchecked
        if not (problem := attention_problem(name, n_head, head_dim, seq_len, device, dtype)):
            return priority_choice(names[i:], notes)
        notes.append(f"attention: {name} fails its check ({problem}); trying the next backend")
    return priority_choice(names[-1:], notes)


def priority_choice(chosen, notes=()):
    """The choice of the backends `chosen`, first preferred, the rest where it cannot run an input."""
    label = f"{chosen[0]} (first of {' > '.join(chosen)}; checked against math)"
    return AttentionChoice(chosen[0], label, tuple(chosen), ordered=True, notes=tuple(notes))


def agreed_attention(choice, device, world):
    """Every rank's choice: the one furthest down the list, so a backend whose check failed on one rank runs on none
    (ranks of one job have the same GPUs and software: they differ only on a fault, then said). One all-reduce."""
    if world == 1:
        return choice
    names = list(ATTENTION_BACKENDS)
    index = torch.tensor([names.index(choice.backends[0]) if choice.ordered else 0], device=device)
    dist.all_reduce(index, op=dist.ReduceOp.MAX)
    if not choice.ordered or (first := int(index.item())) == names.index(choice.backends[0]):
        return choice
    note = f"attention: another rank's check failed down to {names[first]}; every rank uses it"
    return priority_choice(names[first:], (*choice.notes, note))


def has_set_priority():
    """Whether torch's sdpa_kernel takes set_priority (PyTorch PR 140467)."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def default_attention(n_head, head_dim, seq_len, device, dtype):
    """The backend torch picks for causal attention of this shape and dtype, by name ("flash", "math", ...)."""
    q = torch.empty(1, n_head, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    choice = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True))
    return {backend: name for name, backend in ATTENTION_BACKENDS.items()}.get(choice, choice.name.lower())


def attention_problem(name, n_head, head_dim, seq_len, device, dtype=torch.bfloat16):
    """None when backend `name` runs causal attention, forward and backward, at the run's head shape (one sequence of
    seq_len, in dtype) within ATTENTION_TOLERANCE of the math backend in float32; else why not, in a few words."""
    generator = torch.Generator(device=device).manual_seed(0)  # the global seed stays the weights'
    shape = (4, 1, n_head, seq_len, head_dim)
    q, k, v, grad = torch.randn(shape, device=device, dtype=dtype, generator=generator).unbind(0)
    try:
        error = attention_error(ATTENTION_BACKENDS[name], q, k, v, grad)
    except (RuntimeError, NotImplementedError) as e:  # no kernel for this device, dtype or shape
        return f"it does not run here: {first_sentence(e)}"
    if not error <= ATTENTION_TOLERANCE:  # NaN too
        return f"it disagrees with the math backend: relative error {error:.2g} > {ATTENTION_TOLERANCE:g}"
    return None


def first_sentence(error):
    """An error's first sentence, without its full stop, at most 160 characters: what a one-line message can carry."""
    return re.split(r"(?<=\.)\s", (str(error).strip().splitlines() or [""])[0])[0][:160].rstrip(".")


def attention_error(backend, q, k, v, grad):
    """The largest relative error of one backend's output and input gradients against the math backend's in float32
    on the same inputs."""
    reference = sdpa_with_grads(SDPBackend.MATH, *(t.float() for t in (q, k, v, grad)))
    got = sdpa_with_grads(backend, q, k, v, grad)
    return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, reference))


def sdpa_with_grads(backend, q, k, v, grad):
    """(output, dq, dk, dv) of causal attention through one backend alone (an error where it cannot run)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def triton_version():
    """Triton's version, or None where it is not installed (CPU builds of torch)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def major_minor(version):
    """(major, minor) of a version string: "3.5.1" and "3.6.0+git7416ffcb" alike."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def ptxas_version(path):
    """(major, minor) of a ptxas from `ptxas --version` ("Cuda compilation tools, release 12.9, V12.9.86"), or None
    when it does not run or says something else."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def ptxas_candidates(env, cuda_glob="/usr/local/cuda*"):
    """Every ptxas on this machine, in the order looked at: $CUDA_HOME/bin, /usr/local/cuda*/bin (newest name
    first), each folder of PATH; one path per file (the cuda -> cuda-13.0 link is one)."""
    paths = [os.path.join(env["CUDA_HOME"], "bin", "ptxas")] if env.get("CUDA_HOME") else []
    paths += sorted(glob.glob(os.path.join(cuda_glob, "bin", "ptxas")), reverse=True)
    paths += [os.path.join(folder, "ptxas") for folder in env.get("PATH", "").split(os.pathsep) if folder]
    unique = {}
    for path in paths:
        if os.path.isfile(path):
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def point_triton_at_ptxas(capability, triton, env, cuda_glob="/usr/local/cuda*"):
    """On a B300 whose Triton bundles no ptxas for it (Triton < 3.6), and TRITON_PTXAS_PATH not set already: set it in
    env to the first CUDA >= 12.9 ptxas found on the machine, before anything compiles. Returns the line to say: what
    was set, or the warning that compiling will fail; None when there is nothing to do."""
    if capability != B300 or triton is None or major_minor(triton) >= TRITON_FOR_B300 or env.get("TRITON_PTXAS_PATH"):
        return None
    for path in ptxas_candidates(env, cuda_glob):
        if (found := ptxas_version(path)) and found >= PTXAS_FOR_B300:
            env["TRITON_PTXAS_PATH"] = path
            return (
                f"toolchain: Triton {triton}'s own ptxas cannot assemble for sm_103; compiling with {path} "
                f"(CUDA {found[0]}.{found[1]}) through TRITON_PTXAS_PATH"
            )
    return (
        f"warning: Triton {triton}'s own ptxas cannot assemble for sm_103 and no CUDA >= 12.9 ptxas is on this machine "
        f"($CUDA_HOME/bin, /usr/local/cuda*/bin, PATH): compiling will fail at step 0 and training will run eagerly "
        f"(1.5-3x slower); install torch>=2.10 (Triton 3.6), or set TRITON_PTXAS_PATH to a CUDA >= 12.9 ptxas"
    )

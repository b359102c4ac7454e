"""The kernels a run's compute goes through, chosen before the clock: the attention backend of
F.scaled_dot_product_attention, checked against the math backend at the call training makes (layout, micro-batch,
dtype, compiled or not), and on a B300 the ptxas Triton assembles with.
launch.py calls these; train.Trainer.first_compiled_step moves down the backends when step 0 fails inside one. The
versions line and the summary say what was chosen and the op step 0 compiles in. After step 0, a compiled region
whose guards miss runs eagerly (EagerRuns), counted, never recompiled on the clock.

Why: torch 2.9-2.10 prefer cuDNN attention only on compute capability 9.0 and 10.0 (sdp_utils.cpp,
check_prefer_cudnn_attention), so a B300 (10.3) runs the in-tree FlashAttention-2, about half cuDNN's speed on
Blackwell; and a Triton older than 3.6 bundles a ptxas (CUDA 12.8 or older) that cannot assemble sm_103a, so every
compile fails and the run falls back to eager (1.5-3x slower).
"""

import collections
import contextlib
import dataclasses
import glob
import inspect
import os
import re
import subprocess
import time

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
# torch's own rule for preferring cuDNN attention (sdp_utils.cpp, check_prefer_cudnn_attention, from torch 2.10 on):
# a cuDNN above 9.15.0, the first without a memory-safety bug in it (9.15.1, pytorch#169849); auto follows it, and
# also prefers an older cuDNN 9 where the run's sequence length is a multiple of the kernel's 128-row tiles: the bug's
# reproductions all have a ragged last tile (seq 261), the event's 1024 has none, and cuDNN is ~2x flash on Blackwell
CUDNN_PREFERRED_ABOVE = 91500
CUDNN_TILE = 128
B300 = (10, 3)  # compute capability of Blackwell Ultra: ptxas knows sm_103a from CUDA 12.9 on
PTXAS_FOR_B300 = (12, 9)  # and Triton itself pins the CUDA 12.9 ptxas for sm_100/sm_103 (release/3.7.x)
TRITON_FOR_B300 = (3, 6)  # the first Triton to bundle a ptxas for it (ptxas-blackwell, CUDA 12.9); torch 2.10 pins it


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The SDPA call training makes (model.Attention): q, k, v and the output's gradient laid out (batch, seq_len,
    n_head, head_dim), SDPA given their (B, H, T, D) transposes, strides (T*H*D, D, H*D, 1); causal, in dtype, at the
    plan's micro-batch, compiled when training is."""

    batch: int
    seq_len: int
    n_head: int
    head_dim: int
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    compiled: bool = False

    def tensors(self):
        """(q, k, v, the output's gradient), (B, T, H, D) each, seeded apart from the global seed (the weights')."""
        generator = torch.Generator(device=self.device).manual_seed(0)
        shape = (4, self.batch, self.seq_len, self.n_head, self.head_dim)
        return torch.randn(shape, device=self.device, dtype=self.dtype, generator=generator).unbind(0)

    def words(self):
        dtype = str(self.dtype).removeprefix("torch.")
        how = "compiled" if self.compiled else "eager"
        return f"{self.batch} x {self.seq_len} x {self.n_head} x {self.head_dim} (B, T, H, D) {dtype}, {how}"


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """What attention runs: `name` (the summary's "attention"), `label` (the versions line's), how it is applied, and
    `op`, the backend torch picks under it for the training call: the op step 0 compiles in."""

    name: str
    label: str
    backends: tuple = ()  # --attention names enabled, first preferred; () leaves torch's default alone
    ordered: bool = False  # backends are a priority order (sdpa_kernel's set_priority), not only the ones allowed
    notes: tuple = ()  # lines to say: the cuDNN rule, a backend that failed its check and why, the check's time
    call: AttentionCall | None = None  # the training call it was checked at
    op: str = ""

    def active(self):
        """The context training and validation run in (it must hold when step 0 traces the compiled blocks)."""
        if not self.backends:
            return contextlib.nullcontext()
        chosen = [ATTENTION_BACKENDS[name] for name in self.backends]
        return sdpa_kernel(chosen, set_priority=True) if self.ordered else sdpa_kernel(chosen)


def choose_attention(forced, call, capability, cudnn_version=None):
    """The attention backend of a run (--attention `forced`, or "auto") for the training `call`, on a device of compute
    `capability` (None on CPU) with cuDNN `cudnn_version` (torch.backends.cudnn.version()). Auto keeps torch's pick,
    except on compute capability 10.x where torch's sdpa_kernel can set a priority: cuDNN first where torch's own rule
    would prefer it (CUDNN_PREFERRED_ABOVE), then down the list to the first backend whose check passes. A forced
    backend that fails its check is a ValueError."""
    checks = AttentionChecks(call)
    if forced != "auto":
        if problem := checks.problem(forced):
            raise ValueError(
                f"--attention {forced} fails its check at this run's training call ({problem}); force another backend "
                f"or leave --attention auto"
            )
        label = f"{forced} (forced, checked against math)"
        return with_op(AttentionChoice(forced, label, (forced,), notes=(checks.said(),), call=call))
    default = backend_name(fused_choice(AttentionChoice("default", ""), call))
    if capability is None or capability[0] != 10:
        return AttentionChoice(default, f"{default} (torch's pick)", call=call, op=default)
    if not has_set_priority():
        label = f"{default} (torch's pick: this torch's sdpa_kernel cannot set a priority)"
        return AttentionChoice(default, label, call=call, op=default)
    names, notes = list(ATTENTION_BACKENDS), [cudnn_rule(cudnn_version, call.seq_len)]
    if not prefer_cudnn(cudnn_version, call.seq_len):
        names.remove("cudnn")
    for i, name in enumerate(names[:-1]):  # math is the reference: the floor, unchecked
        if not (problem := checks.problem(name)):
            return priority_choice(names[i:], (*notes, checks.said()), call)
        notes.append(f"attention: {name} fails its check ({problem}); trying the next backend")
    return priority_choice(names[-1:], (*notes, checks.said()), call)


def prefer_cudnn(version, seq_len):
    """Whether auto puts cuDNN attention first: above 9.15.0 (torch's own rule), or a cuDNN 9 at a sequence length of
    whole 128-row tiles (CUDNN_PREFERRED_ABOVE's note)."""
    return (version or 0) > CUDNN_PREFERRED_ABOVE or ((version or 0) >= 90000 and seq_len % CUDNN_TILE == 0)


def cudnn_rule(version, seq_len):
    """The line that says whether auto puts cuDNN attention first, and by which rule."""
    release = cudnn_release(version)
    if (version or 0) > CUDNN_PREFERRED_ABOVE:
        return f"attention: cuDNN {release} is above 9.15.0, where torch's own rule prefers cuDNN: first"
    if prefer_cudnn(version, seq_len):
        return (
            f"attention: cuDNN {release} is not above 9.15.0 (torch's own rule would not prefer it), but --seq_len "
            f"{seq_len} is whole {CUDNN_TILE}-row tiles, where its known memory-safety bug (fixed in 9.15.1) has no "
            f"trigger: first, checked at the training call"
        )
    return (
        f"attention: cuDNN {release} is not above 9.15.0, below which torch's own rule does not prefer cuDNN attention "
        f"(9.15.1 fixed a memory-safety bug in it, triggered by a ragged last tile: --seq_len {seq_len}): cudnn left "
        f"out, --attention cudnn forces it"
    )


def cudnn_release(version):
    """cuDNN's version number as its release (91002: "9.10.2"); an older numbering as it is; None: "none"."""
    if not version:
        return "none"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}" if version >= 90000 else str(version)


class AttentionChecks:
    """Backends checked one by one at a training call against the math backend in float32 on the same inputs; the
    inputs and the reference are made once, at the first check."""

    def __init__(self, call):
        self.call, self.inputs, self.reference, self.names, self.seconds = call, None, None, [], 0.0

    def problem(self, name):
        """None when backend `name` runs the call, forward and backward, within ATTENTION_TOLERANCE of math; else why
        not, in a few words."""
        start = time.perf_counter()
        if self.inputs is None:
            self.inputs = self.call.tensors()
            self.reference = sdpa_with_grads(SDPBackend.MATH, *(t.float() for t in self.inputs))
        self.names.append(name)
        try:
            return attention_problem(ATTENTION_BACKENDS[name], self.inputs, self.reference, self.call.compiled)
        finally:
            if self.call.device.type == "cuda":
                torch.cuda.synchronize(self.call.device)
            self.seconds += time.perf_counter() - start

    def said(self):
        return (
            f"attention: checked {', '.join(self.names)} at the training call ({self.call.words()}) against math in "
            f"{self.seconds:.1f} s"
        )


def attention_problem(backend, inputs, reference, compiled):
    """None when `backend` gives `reference`'s output and input gradients on `inputs` within ATTENTION_TOLERANCE,
    else why not, in a few words."""
    q, k, v, grad = inputs
    try:
        got = sdpa_with_grads(backend, q, k, v, grad, compiled=compiled)
    except Exception as e:  # no kernel for this device, dtype, shape or layout, or a compile that fails
        return f"it does not run here: {error_sentence(e)}"
    error = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, reference))
    if not error <= ATTENTION_TOLERANCE:  # NaN too
        return f"it disagrees with the math backend: relative error {error:.2g} > {ATTENTION_TOLERANCE:g}"
    return None


def priority_choice(chosen, notes=(), call=None):
    """The choice of the backends `chosen`, first preferred, the rest where it cannot run an input; with the op it
    compiles in at `call`."""
    label = f"{chosen[0]} (first of {' > '.join(chosen)}; checked against math)"
    return with_op(AttentionChoice(chosen[0], label, tuple(chosen), ordered=True, notes=tuple(notes), call=call))


def with_op(choice):
    """The choice with its op at its training call (none without one)."""
    return dataclasses.replace(choice, op=backend_name(fused_choice(choice, choice.call))) if choice.call else choice


def fused_choice(choice, call):
    """The backend torch picks under the choice for the training call (torch._fused_sdp_choice on its strided q, k,
    v, gradients required): the op a compiled graph traced then calls; SDPBackend.ERROR where none can."""
    shape = (call.batch, call.seq_len, call.n_head, call.head_dim)
    q = torch.empty(shape, device=call.device, dtype=call.dtype, requires_grad=True).transpose(1, 2)
    with choice.active():
        try:
            return torch._fused_sdp_choice(q, q, q, is_causal=True)
        except RuntimeError:  # no backend allowed can run it ("No viable backend")
            return SDPBackend.ERROR.value


def backend_name(index):
    """An SDPBackend's --attention name ("flash", "math", ...), or torch's own in lower case ("error": none runs)."""
    backend = SDPBackend(index)
    return {b: name for name, b in ATTENTION_BACKENDS.items()}.get(backend, backend.name.lower())


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
    return priority_choice(names[first:], (*choice.notes, note), choice.call)


def has_set_priority():
    """Whether torch's sdpa_kernel takes set_priority (PyTorch PR 140467)."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def first_sentence(error):
    """An error's first sentence, without its full stop, at most 160 characters: what a one-line message can carry."""
    return re.split(r"(?<=\.)\s", (str(error).strip().splitlines() or [""])[0])[0][:160].rstrip(".")


def error_sentence(error):
    """first_sentence of the error at the root of what a compile failure wraps (dynamo's own messages say little)."""
    return first_sentence(error_chain(error)[-1])


def error_chain(error):
    """The error and the ones it wraps (inner_exception, __cause__, __context__), outermost first."""
    chain: list[BaseException] = []
    while error is not None and all(error is not seen for seen in chain):
        chain.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return chain


def training_attention(q, k, v):
    """Causal attention as model.Attention calls it: q, k, v (B, T, H, D), SDPA on their transposes, the output
    back to (B, T, H, D)."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2)


def attention_error(backend, q, k, v, grad):
    """The largest relative error of one backend's output and input gradients against the math backend's in float32
    on the same (B, T, H, D) inputs, eagerly."""
    reference = sdpa_with_grads(SDPBackend.MATH, *(t.float() for t in (q, k, v, grad)))
    got = sdpa_with_grads(backend, q, k, v, grad)
    return max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, reference))


def sdpa_with_grads(backend, q, k, v, grad, compiled=False):
    """(output, dq, dk, dv) of training_attention through one backend alone (an error where it cannot run), eager or
    compiled as training compiles a block (the graph then forgotten: it is no graph of the run's)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attend = torch.compile(training_attention, fullgraph=True, dynamic=False) if compiled else training_attention
    counts = compile_counts()
    try:
        with sdpa_kernel([backend]):
            out = attend(q, k, v)
            out.backward(grad)
    finally:
        if compiled:
            forget_compiles(counts)
    return out.detach(), q.grad, k.grad, v.grad


# ----------------------------------------------------------------------------- step 0 fails inside attention

ATTENTION_WORDS = re.compile(r"attention|sdpa|cudnn|flash", re.IGNORECASE)
# a compiler toolchain that fails (ptxas, Triton, the C++ compiler) fails under every backend alike
TOOLCHAIN_WORDS = re.compile(r"ptxas|triton|c\+\+ compile|cppcompile|nvcc|compilation subprocess", re.IGNORECASE)


def failed_in_attention(error):
    """Whether an error of step 0 comes from the attention backend (its kernel, or inductor's lowering of it): the
    messages of the error and its causes name attention, cuDNN or flash, and no compiler toolchain."""
    text = "\n".join(str(e)[:10000] for e in error_chain(error))
    return bool(ATTENTION_WORDS.search(text)) and not TOOLCHAIN_WORDS.search(text)


def next_attention(choice):
    """After step 0 failed inside the choice's first backend: the backends after it, from the first whose eager check
    passes at the same call (math: unchecked); None when none is after it."""
    if not choice.ordered or len(choice.backends) < 2:
        return None
    checks = AttentionChecks(dataclasses.replace(choice.call, compiled=False))  # the compiled retry comes next
    rest, notes = list(choice.backends[1:]), []
    while len(rest) > 1 and (problem := checks.problem(rest[0])):
        notes.append(f"attention: {rest[0]} fails its check ({problem}); trying the next backend")
        rest.pop(0)
    if checks.names:
        notes.append(checks.said())
    return priority_choice(rest, notes, choice.call)


def switch_attention(choice):
    """Make the choice torch's SDPA setting now, for the rest of the run: inside train.main's choice.active(), which
    puts torch's own setting back when it ends (the setting is global; no context of its own to close). Returns it."""
    torch.nn.attention._sdpa_kernel([ATTENTION_BACKENDS[name] for name in choice.backends], set_priority=True)
    return choice


def compile_counts():
    """dynamo's compile counters now (report.compiled_graphs reads "unique_graphs")."""
    return collections.Counter(torch._dynamo.utils.counters["stats"])


def forget_compiles(counts):
    """Every compiled graph dropped (torch._dynamo.reset) and dynamo's counters put back to `counts`: graphs compiled
    by a check, or under a backend step 0 moved away from, are not the run's (its summary counts the run's)."""
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    stats.clear()
    stats.update(counts)


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
    """Every ptxas on this machine, in the order looked at: $CUDA_HOME/bin, /usr/local/cuda*/bin (by name, newest
    first), each folder of PATH; one path per file (the cuda -> cuda-13.0 link is one)."""
    paths = [os.path.join(env["CUDA_HOME"], "bin", "ptxas")] if env.get("CUDA_HOME") else []
    paths += sorted(glob.glob(os.path.join(cuda_glob, "bin", "ptxas")), reverse=True)
    paths += [os.path.join(folder, "ptxas") for folder in env.get("PATH", "").split(os.pathsep) if folder]
    unique: dict[str, str] = {}  # real path -> the first path found to it
    for path in paths:
        if os.path.isfile(path):
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def point_triton_at_ptxas(capability, triton, env, cuda_glob="/usr/local/cuda*"):
    """On a B300 whose Triton bundles no ptxas for it (Triton < 3.6), and TRITON_PTXAS_PATH not set already: set it in
    env, before anything compiles, to the ptxas Triton itself would take, CUDA 12.9's; only when there is none, the
    oldest newer one (cubins of a newer toolkit need a driver of that CUDA or newer). Returns the line to say: what
    was set, or the warning that compiling will fail; None when there is nothing to do."""
    if capability != B300 or triton is None or major_minor(triton) >= TRITON_FOR_B300 or env.get("TRITON_PTXAS_PATH"):
        return None
    found = [
        (v, path) for path in ptxas_candidates(env, cuda_glob) if (v := ptxas_version(path)) and v >= PTXAS_FOR_B300
    ]
    if found:
        version, path = min(found, key=lambda item: item[0])  # the first found of the oldest version
        env["TRITON_PTXAS_PATH"] = path
        cuda = f"CUDA {version[0]}.{version[1]}"
        why = (
            "the one Triton itself pins for sm_100/sm_103"
            if version == PTXAS_FOR_B300
            else f"none of CUDA 12.9, which Triton itself pins for sm_100/sm_103, is here: it needs a {cuda}+ driver"
        )
        return (
            f"toolchain: Triton {triton}'s own ptxas cannot assemble for sm_103; compiling with {path} ({cuda}, {why}) "
            f"through TRITON_PTXAS_PATH"
        )
    return (
        f"warning: Triton {triton}'s own ptxas cannot assemble for sm_103 and no CUDA >= 12.9 ptxas is on this machine "
        f"($CUDA_HOME/bin, /usr/local/cuda*/bin, PATH): compiling will fail at step 0 and training will run eagerly "
        f"(1.5-3x slower); install torch>=2.10 (Triton 3.6), or set TRITON_PTXAS_PATH to a CUDA >= 12.9 ptxas"
    )


class EagerRuns:
    """After step 0 the stance is fail_on_recompile: a compiled region whose guards miss (a new input shape, a changed
    guard) raises before it runs anything; that call then runs eagerly (2-3x slower, but no recompile on the clock),
    said once and counted for the summary. With --on_recompile fail the error stands."""

    def __init__(self, say, fail_on_miss):
        self.say, self.fail_on_miss, self.count = say, fail_on_miss, 0

    def wrap(self, compiled):
        def call(*args, **kwargs):
            try:
                return compiled(*args, **kwargs)
            except RuntimeError as e:
                if self.fail_on_miss or "Detected recompile" not in str(e):
                    raise
                miss = " ".join(str(e).split())[:300]
            self.count += 1
            if self.count == 1:
                self.say(f"warning: a compiled graph's guards missed after step 0; it runs eagerly, slower ({miss})")
            with torch.compiler.set_stance("force_eager"):
                return compiled(*args, **kwargs)

        return call

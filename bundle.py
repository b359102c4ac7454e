"""Build the two-file submission the event accepts: model.py + a self-contained train.py (+ requirements.txt).

    python bundle.py OUT_DIR            # write OUT_DIR/{model.py, train.py, requirements.txt}
    python bundle.py OUT_DIR --check    # exit 1 if OUT_DIR is not what bundling would write now

OUT_DIR is a separate folder, new or not: the repo folder, a link or a bind mount of it, a file or "" is refused (exit
2) before anything is written, as is any folder whose files would overwrite a source bundle.py reads (files are
compared by identity, so a hard link is caught too). Each file is written under a temporary name and renamed into
place, so a link in OUT_DIR is replaced, never written through.

model.py is copied byte for byte (the organizers import it alone). The modules of PASTED go into train.py above
its own code, each after the ones it imports and under one line saying what it is for (SECTIONS): its docstring as a
comment block (muon.py's distributed contract is what a reader of the submission needs), its imports merged into one
sorted block at the top (import_block), and of its code only what a training run can reach: the top-level definitions
that train.py's code names, directly or through other kept code. So data_cli.py and synthetic.py's writer stay
behind. A top-level name bound in two files is an error. A table of contents after the imports lists the sections,
train.py's own last. tests/test_ship.py checks that the bundle trains step for step like the repo.
"""

import argparse
import ast
import os
import pathlib
import sys
from typing import NoReturn

# The pasted modules, each after the modules it imports (their definitions run at import), with what each is for: the
# one line that opens its section of the bundled train.py. train.py's own code (the flags, the schedule, the loop)
# comes last, as it calls everything above it; the bundle's table of contents says so first.
SECTIONS = {
    "checkpoint": "checkpoint files: complete and finite on disk, saved without holding up training",
    "clock": "the loop's clock: when to sync, each step's progress and accumulation, when to stop",
    "rollback": "a loss that blows up: snapshots, the divergence test, the restore with lower LRs",
    "tailema": "the tail EMA: the weights' average over the decay's last part, blended into the final checkpoint",
    "headloss": "the training loss: the head's matmul and cross-entropy a chunk of rows at a time",
    "plan": "the run plan before the clock: shape, tokens per step, micro-batch, forecast steps",
    "schedule": "the schedule as a function of progress: LR fraction, Muon momentum; each group's LR",
    "windows": "the token-file format and the training windows read from it",
    "synthetic": "the built-in synthetic data (a Markov chain whose best loss is known)",
    "config": "the hyperparameters: one dataclass, its flags (the organizers' names verbatim), their checks",
    "shards": "which blocks of the data each rank reads, epoch by epoch",
    "prefetch": "batches kept ready by a background thread, pinned and copied to the device",
    "data": "the data front: token files checked and loaded, BatchLoader, validation batches",
    "paths": "the files a run reads and writes, checked before anything is written",
    "muon": "Muon for the hidden matrices, sharded across ranks",
    "optimizers": "which optimizer steps which parameter (Muon, a cautious AdamW) and Snoo's outer step",
    "kernels": "the attention backend and, on a B300, the ptxas Triton uses: chosen and checked before the clock",
    "ranks": "the torch floor, process group and devices, ranks leaving together, warm collectives, stop signals",
    "deadline": "the SLURM-aware budget: one deadline for every rank, taken again right before the clock",
    "streams": "stdout and stderr that may go away (a dead tee, a hang-up) without ending the run",
    "report": "what a run reports: metrics rows, the progress bar, the summary row, the human summary",
    "resume": "the training state beside the checkpoint: saved, found, checked and loaded, so a run goes on in a job",
    "launch": "everything before the clock, in order; returns the Run the loop reads",
}
PASTED = list(SECTIONS)
SHIPPED = "model"  # next to train.py, so its imports stay
REQUIREMENTS = ["torch", "numpy", "tqdm"]
VERSIONS = {"torch": ">=2.6"}  # ranks.TORCH_FLOOR: the oldest torch the run path works on
# requirements.txt's first lines: what a B300 needs, said, not required. A floor of torch>=2.10 there could make the
# organizers' `pip install -r` replace the CUDA build of torch they installed with another
REQUIREMENTS_NOTE = (
    "# On a B300 (compute capability 10.3) install torch>=2.10: its Triton 3.6 is the first whose ptxas assembles for\n"
    "# it. With an older torch, train.py points Triton at a CUDA >= 12.9 ptxas on the machine (TRITON_PTXAS_PATH),\n"
    "# else it warns and trains eagerly. The floor below stays 2.6 so pip keeps the torch build already installed.\n"
)


class BundleError(ValueError):
    pass


def fail(message) -> NoReturn:
    """Exit status 2 with one sentence on stderr; the SystemExit carries the sentence too, for callers of main."""
    print(f"error: {message}", file=sys.stderr)
    error = SystemExit(f"error: {message}")
    error.code = 2
    raise error


class OneSentenceParser(argparse.ArgumentParser):
    """argparse whose error (a flag it cannot read) is fail's one sentence; --help still shows the usage."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def is_main_block(node):
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", "'__main__' == __name__")


def bound_names(node):
    """Top-level names a statement binds (a def, a class, an assignment's targets)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def source_of(node, lines):
    """A statement's source with its decorators and the comment lines right above it."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return "\n".join(lines[start : node.end_lineno])


def purposes(trees):
    """{module: the one line saying what its section is for}: SECTIONS', else its docstring's first line."""
    purpose = {
        name: SECTIONS.get(name) or (ast.get_docstring(tree) or "").partition("\n")[0] for name, tree in trees.items()
    }
    purpose["train"] = "the flags, the schedule and the training loop (last: it calls everything above)"
    return purpose


def contents(purpose):
    """The bundle's table of contents: each section in order, with what it is for."""
    width = max(map(len, purpose)) + 5
    lines = [f"#   {name + '.py':<{width}}{line}".rstrip() for name, line in purpose.items()]
    return (
        "# The sections below, pasted by bundle.py from the repo's modules (of each, only what a run can reach):\n"
        + "\n".join(lines)
    )


def import_block(imports):
    """Every pasted module's imports as one block, as a reader expects them: the standard library, then the
    requirements, then model.py; `import X` lines sorted, `from X import` lines merged by module."""
    groups: list[dict[str, None]] = [{}, {}, {}]  # line -> None, an ordered set per group

    def group(module):
        root = module.split(".")[0]
        return 0 if root in sys.stdlib_module_names else 2 if root == SHIPPED else 1

    merged: dict[str, set[str]] = {}  # module -> the names imported from it
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                groups[group(alias.name)][f"import {ast.unparse(alias)}"] = None
        else:
            merged.setdefault(node.module, set()).update(ast.unparse(alias) for alias in node.names)
    for module, names in merged.items():
        groups[group(module)][f"from {module} import {', '.join(sorted(names))}"] = None
    by_kind = [sorted(lines, key=lambda line: (line.startswith("from"), line)) for lines in groups]
    return "\n\n".join("\n".join(lines) for lines in by_kind if lines)


def bundle_files(src_dir, pasted=PASTED):
    """{file name: text} of the submission built from the sources in src_dir."""
    src_dir = pathlib.Path(src_dir)
    files = {name: src_dir / f"{name}.py" for name in [*pasted, "train"]}
    if missing := [path.name for path in [*files.values(), src_dir / "model.py"] if not path.is_file()]:
        raise BundleError(f"--src {src_dir} lacks {', '.join(missing)}; it must be the repo folder.")
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in files.items()}
    imports: list[ast.Import | ast.ImportFrom] = []  # those the bundle keeps: not of a pasted module
    roots: set[str] = set()  # the top-level packages they load
    code: dict[str, list[ast.stmt]] = {}  # module -> its statements
    owner: dict[str, tuple[str, ast.stmt]] = {}  # top-level name -> (module, node)
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Import):
                loaded = {a.name.split(".")[0] for a in node.names}
                if loaded & set(pasted):
                    raise BundleError(f"{name}.py:{node.lineno} imports a pasted module whole; use `from X import`.")
                imports.append(node)
                roots |= loaded
            elif isinstance(node, ast.ImportFrom):
                if node.module is None or node.level:  # the repo is no package, and the bundle is one file
                    raise BundleError(f"{name}.py:{node.lineno} imports relatively; name the module: `from X import`.")
                if node.module not in pasted:
                    imports.append(node)
                    roots.add(node.module.split(".")[0])
            elif not (is_docstring(node) and node is tree.body[0]) and not (name != "train" and is_main_block(node)):
                code.setdefault(name, []).append(node)
                for bound in bound_names(node):
                    if bound in owner and owner[bound][0] != name:
                        raise BundleError(
                            f"{bound!r} is bound in {owner[bound][0]}.py:{owner[bound][1].lineno} and "
                            f"{name}.py:{node.lineno}; one namespace cannot hold both, rename one."
                        )
                    owner[bound] = (name, node)
    keep = reachable(code, owner)
    if missing := sorted(roots - sys.stdlib_module_names - set(REQUIREMENTS) - {SHIPPED}):
        raise BundleError(f"{', '.join(missing)} would be needed at run time but is not in REQUIREMENTS.")
    header = ast.get_docstring(trees["train"], clean=False)
    purpose = purposes(trees)
    parts = [f'"""{header}"""', import_block(imports), contents(purpose)]
    for name in pasted:
        lines = files[name].read_text().splitlines()
        doc = ast.get_docstring(trees[name]) or ""
        kept = [source_of(node, lines) for node in code.get(name, []) if id(node) in keep]
        comment = "\n".join(f"# {line}".rstrip() for line in doc.splitlines())
        parts.append(f"# ---- {name}.py: {purpose[name]}\n{comment}\n\n" + "\n\n\n".join(kept))
    lines = files["train"].read_text().splitlines()
    parts.append(f"# ---- train.py: {purpose['train']}\n" + "\n".join(lines[code["train"][0].lineno - 1 :]))
    return {
        "model.py": (src_dir / "model.py").read_text(),
        "train.py": "\n\n\n".join(parts) + "\n",
        "requirements.txt": REQUIREMENTS_NOTE + "".join(f"{name}{VERSIONS.get(name, '')}\n" for name in REQUIREMENTS),
    }


def reachable(code, owner):
    """ids of the statements a training run can reach: train.py's code and the statements that bind nothing (side
    effects), then every statement that binds a name they use, and so on."""
    keep: set[int] = set()
    todo = [node for name, nodes in code.items() for node in nodes if name == "train" or not bound_names(node)]
    while todo:
        node = todo.pop()
        if id(node) not in keep:
            keep.add(id(node))
            todo += [owner[n.id][1] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in owner]
    return keep


def file_identity(path):
    """(device, inode) of the file path reaches, or None: the same for every path to one file (a hard link, a symlink,
    a bind mount). A copy of paths.file_identity: bundle.py imports nothing of ours."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def check_out_dir(out_dir, src_dir, names):
    """Refuse, before anything is written, an OUT_DIR that is not a separate folder: one whose files would overwrite
    a source being read (the repo itself, a link or a mount of it, a link to one of its files), a file, or nothing."""
    if not out_dir:
        raise BundleError("OUT_DIR is empty; give the folder to write the submission into.")
    out = pathlib.Path(out_dir)
    there = next(p for p in [out, *out.absolute().parents] if p.exists())  # the first part that exists
    if not there.is_dir():
        raise BundleError(f"OUT_DIR {out} is {'a file' if there == out else f'under the file {there}'}, not a folder.")
    paths = [pathlib.Path(src_dir) / f"{name}.py" for name in [*PASTED, "train", SHIPPED]]
    sources = {file_identity(path): path.resolve() for path in paths}
    sources.pop(None, None)  # a source that is not there (bundle_files says so first)
    for name in names:
        target = out / name
        if (source := sources.get(file_identity(target))) is not None:
            raise BundleError(
                f"OUT_DIR {out} would overwrite {source}, a source bundle.py reads; give a separate folder."
            )
        if target.exists() and not target.is_file():
            raise BundleError(f"OUT_DIR {out} holds {name} as a folder, so the submission's {name} cannot be written.")


def write_replacing(path, text):
    """Write text under a temporary name beside path, then rename it over path: a link at path is replaced, never
    written through, and a write that fails leaves the old file."""
    tmp = path.with_name(f".{path.name}.bundling")
    tmp.unlink(missing_ok=True)
    try:
        with open(tmp, "x") as file:  # "x": a link planted at the temporary name is not followed either
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def main(argv=None):
    parser = OneSentenceParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--check", action="store_true", help="compare OUT_DIR with a fresh bundle, write nothing")
    parser.add_argument("--src", default=pathlib.Path(__file__).resolve().parent, help="the repo folder")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out_dir)
    try:
        files = bundle_files(args.src)
        check_out_dir(args.out_dir, args.src, files)  # before anything is written
        if not args.check:
            out.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                write_replacing(out / name, text)
    except (BundleError, SyntaxError, OSError) as e:  # one sentence, exit 2 as eval.py
        fail(e)
    if args.check:
        stale = [name for name, text in files.items() if not (out / name).is_file() or (out / name).read_text() != text]
        if stale:
            sys.exit(f"{out} is out of date: {', '.join(stale)} differ from a fresh bundle; run python bundle.py {out}")
        print(f"{out} is up to date")
        return
    print(f"wrote {', '.join(files)} to {out}")


if __name__ == "__main__":
    main()

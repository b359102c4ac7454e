"""The house in numbers: lines per module, functions over 60 lines, and the path from train.main() to the first
optimizer step (distinct functions of ours called on it, before and after the clock starts, and the modules they sit
in), counted on a tiny CPU run of the built-in data.

    python bench/house.py             # the table, for this checkout
    python bench/house.py --json      # the same, as one JSON object
"""

import argparse
import ast
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LONG = 60  # lines: a function longer than this does not read on one screen
TINY = "--n_layer 2 --n_head 2 --n_embd 64 --seq_len 32 --batch_tokens 256 --val_tokens 4096 --val_eval_tokens 2048"


def module_sizes():
    """{module: lines} and [(module.function, lines)] over LONG, for the repo's top-level modules."""
    sizes, long = {}, []
    for path in sorted(REPO.glob("*.py")):
        source = path.read_text()
        sizes[path.stem] = len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG:
                    long.append((f"{path.stem}.{node.name}", length))
    return sizes, sorted(long, key=lambda item: -item[1])


def path_to_first_step(max_steps=3):
    """Distinct functions of the repo's modules called on the main thread from train.main() to the first optimizer
    step: (before the clock, after it), each a list of "module.function" in order of first call. The clock starts
    at train.py's gc.disable(), right before its first forward pass."""
    ours = {str(path) for path in REPO.glob("*.py")}
    seen, phase = {"before": [], "after": []}, ["before"]

    def hook(frame, event, arg):
        if phase[0] == "done":
            return
        if event == "c_call" and arg is gc.disable and frame.f_code.co_filename == str(REPO / "train.py"):
            phase[0] = "after"
        if event != "call":
            return
        code = frame.f_code
        owner = frame.f_locals.get("self")
        if code.co_name == "step" and owner is not None and _is_optimizer(owner):
            phase[0] = "done"
            return
        if code.co_filename in ours and not code.co_name.startswith("<"):
            name = f"{Path(code.co_filename).stem}.{code.co_qualname}"
            if name not in seen["before"] and name not in seen["after"]:
                seen[phase[0]].append(name)

    sys.path.insert(0, str(REPO))
    import train

    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        argv = [*TINY.split(), "--max_steps", str(max_steps), "--checkpoint_path", f"{folder}/ckpt.pt"]
        sys.setprofile(hook)
        try:
            train.main(argv)
        finally:
            sys.setprofile(None)
    return seen["before"], seen["after"]


def _is_optimizer(owner):
    import torch

    return isinstance(owner, torch.optim.Optimizer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes, long = module_sizes()
    stdout = sys.stdout
    sys.stdout = open(os.devnull, "w")  # the tiny run's own lines
    try:
        before, after = path_to_first_step()
    finally:
        sys.stdout.close()
        sys.stdout = stdout
    modules = sorted({name.split(".")[0] for name in before + after})
    result = {
        "modules": len(sizes),
        "lines": sum(sizes.values()),
        "largest": sorted(sizes.items(), key=lambda item: -item[1])[:8],
        "functions_over_60_lines": long,
        "functions_main_to_first_step": len(before) + len(after),
        "of_them_before_the_clock": len(before),
        "modules_on_the_path": len(modules),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['modules']} modules, {result['lines']:,} lines; largest: {result['largest']}")
    print(f"functions over {LONG} lines: {long or 'none'}")
    print(
        f"main() to the first optimizer step: {len(before) + len(after)} functions of ours in {len(modules)} modules, "
        f"{len(before)} before the clock"
    )


if __name__ == "__main__":
    main()

"""Build the two-file submission the event accepts: model.py + a self-contained train.py (+ requirements.txt).

    python bundle.py OUT_DIR            # write OUT_DIR/{model.py, train.py, requirements.txt}
    python bundle.py OUT_DIR --check    # exit 1 if OUT_DIR is not what bundling would write now

model.py is copied byte for byte (the organizers import it alone). Every repo module that train.py imports,
other than model.py, is pasted into train.py, dependencies first: its source as written, minus its docstring,
imports and `if __name__ == "__main__":` block, under a one-line header. The imports of all files are merged
into one block and the `from X import ...` lines of pasted modules dropped, so train.py's code runs unchanged
against the same objects. A top-level name bound by two of the files would silently shadow the other in one
namespace, so it is an error. This file imports nothing of ours: it reads the sources.
"""
import argparse
import ast
import pathlib
import sys

REQUIREMENTS = {"torch": "torch", "numpy": "numpy", "tqdm": "tqdm"}  # import name -> pip name
SHIPPED = "model"  # shipped next to train.py, so it stays imported
MAX_LINE = 120


class BundleError(ValueError):
    pass


def is_main_block(node):
    """`if __name__ == "__main__":` (either operand order)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(side) for side in (node.test.left, node.test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


class Module:
    """One source file: its top-level imports, the names it binds and the statements that get pasted."""

    def __init__(self, path, src_dir, pasted):
        self.path, self.name, self.pasted = path, path.stem, pasted
        self.text = path.read_text()
        try:
            self.tree = ast.parse(self.text, filename=str(path))
        except SyntaxError as e:
            raise BundleError(f"{path} does not parse: {e}") from None
        self.imports = [node for node in self.tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        # what runs: a pasted module loses its main block
        self.statements = [node for node in self.tree.body if not (pasted and is_main_block(node))]
        code = [node for node in self.tree.body if node not in self.imports and not (
            node is self.tree.body[0] and is_docstring(node))]
        if code and self.imports and self.imports[-1].lineno > code[0].lineno:  # e.g. an env var set for torch
            raise BundleError(f"{path.name}:{self.imports[-1].lineno} imports after top-level code (line "
                              f"{code[0].lineno}); bundle.py moves imports to the top, so put it there.")
        self.local = {}  # repo module to paste -> the import nodes that name it
        for node in ast.walk(ast.Module(self.statements, [])):
            for module in self._imported_modules(node):
                if module != SHIPPED and (src_dir / f"{module}.py").is_file():
                    if node not in self.imports:
                        raise BundleError(f"{path.name}:{node.lineno} imports {module} inside a block; bundle.py "
                                          f"only merges top-level imports, so move it to the top of the file.")
                    self.local.setdefault(module, []).append(node)
        self.pasted_imports = [node for nodes in self.local.values() for node in nodes]
        self.defined = self._defined_names()

    def _imported_modules(self, node):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                raise BundleError(f"{self.path.name}:{node.lineno} has a relative import; the flat layout "
                                  f"needs absolute ones.")
            return [node.module.split(".")[0]]
        if isinstance(node, ast.Import):
            return [alias.name.split(".")[0] for alias in node.names]
        return []

    def _defined_names(self):
        """Top-level names bound other than by a top-level import: defs, classes, assignments (also inside
        top-level if/for/with/try), imports nested in those blocks, and `global` names set inside functions."""
        names = {}

        def visit(node):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.setdefault(child.name, child.lineno)
                elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
                    names.setdefault(child.id, child.lineno)
                elif isinstance(child, ast.ExceptHandler) and child.name:
                    names.setdefault(child.name, child.lineno)
                    visit(child)
                elif isinstance(child, (ast.Import, ast.ImportFrom)):
                    if child not in self.imports:
                        for alias in child.names:
                            names.setdefault((alias.asname or alias.name).split(".")[0], child.lineno)
                elif not isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                    visit(child)

        statements = ast.Module(self.statements, [])
        visit(statements)
        for node in ast.walk(statements):
            if isinstance(node, ast.Global):
                for name in node.names:
                    names.setdefault(name, node.lineno)
        return names

    def bindings(self):
        """name -> what it is bound to: ("import", dotted path) or ("def", line). A pasted module's names
        are its own, so importing them binds nothing new, except under another name (an alias line)."""
        out = {name: ("def", line) for name, line in self.defined.items()}
        out.update((a.asname, ("def", node.lineno)) for node in self.pasted_imports for a in node.names
                   if a.asname and a.asname != a.name)
        for node in self.imports:
            if node in self.pasted_imports:
                continue
            for alias in node.names:
                if isinstance(node, ast.ImportFrom):
                    name, path = alias.asname or alias.name, f"{node.module}.{alias.name}"
                elif alias.asname:
                    name, path = alias.asname, alias.name
                else:
                    name = path = alias.name.split(".")[0]
                out.setdefault(name, ("import", path))  # rebound in the file: the def counts
        return out

    def alias_lines(self):
        """`from data import X as Y` bound Y; once pasted, X is a global and Y must be assigned from it."""
        return [f"{a.asname} = {a.name}" for node in self.pasted_imports for a in node.names
                if a.asname and a.asname != a.name]

    def body(self, start=1):
        """The source from line `start` with top-level imports cut out and, when pasted, the docstring and the
        main block too."""
        dropped = [node for node in self.tree.body if node in self.imports or node not in self.statements
                   or (self.pasted and node is self.tree.body[0] and is_docstring(node))]
        cut = set()
        for node in dropped:
            cut.update(range(node.lineno, node.end_lineno + 1))
        for node in self.tree.body:
            if node not in dropped and cut.intersection(range(node.lineno, node.end_lineno + 1)):
                raise BundleError(f"{self.path.name}:{node.lineno} shares a line with an import or the main block; "
                                  f"put each on its own line.")
        lines = [line for i, line in enumerate(self.text.splitlines(), 1) if i >= start and i not in cut]
        return squeeze_blank_lines(lines)


def squeeze_blank_lines(lines):
    """Strip blank lines at both ends and keep at most two in a row (PEP 8 between top-level defs)."""
    out = []
    for line in lines:
        if line.strip() or (out and any(previous.strip() for previous in out[-2:])):
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def paste_order(src_dir):
    """train.py and the local modules it needs, dependencies before their importers."""
    order, visiting = [], []

    def visit(name):
        if any(module.name == name for module in order):
            return
        if name in visiting:
            raise BundleError(f"circular import between {' -> '.join(visiting + [name])}.")
        visiting.append(name)
        module = Module(src_dir / f"{name}.py", src_dir, pasted=name != "train")
        for dependency in module.local:
            visit(dependency)
        visiting.pop()
        order.append(module)

    visit("train")
    return order


def merged_imports(modules):
    """One import block for every file: the top-level imports of all of them, deduplicated, grouped as
    __future__ / stdlib / third-party / model, plain imports before from-imports within a group."""
    futures = {tuple(sorted(a.name for node in m.imports if isinstance(node, ast.ImportFrom)
                            and node.module == "__future__" for a in node.names)) for m in modules}
    if len(futures) > 1:  # e.g. `annotations` would turn train.py's dataclass field types into strings
        raise BundleError("the pasted files use different `from __future__` imports; make them agree.")
    plain, from_names = set(), {}
    for module in modules:
        for node in module.imports:
            if node in module.pasted_imports:
                continue
            if isinstance(node, ast.Import):
                plain.update((alias.name, alias.asname) for alias in node.names)
            else:
                from_names.setdefault(node.module, set()).update((a.name, a.asname) for a in node.names)

    def group(module):
        root = module.split(".")[0]
        if root == "__future__":
            return 0
        if root == SHIPPED:
            return 3
        if root in sys.stdlib_module_names:
            return 1
        if root not in REQUIREMENTS:
            raise BundleError(f"the bundle imports {root}, which REQUIREMENTS in bundle.py does not list; add it "
                              f"there so requirements.txt installs it.")
        return 2

    def as_text(name, asname):
        return f"{name} as {asname}" if asname else name

    groups = [[] for _ in range(4)]
    for name, asname in sorted(plain, key=lambda item: (item[0], item[1] or "")):
        groups[group(name)].append(f"import {as_text(name, asname)}")
    for module in sorted(from_names):
        names = ", ".join(as_text(*item) for item in sorted(from_names[module], key=lambda i: (i[0], i[1] or "")))
        line = f"from {module} import {names}"
        if len(line) > MAX_LINE:
            line = f"from {module} import (\n    " + ",\n    ".join(names.split(", ")) + ",\n)"
        groups[group(module)].append(line)
    return "\n\n".join("\n".join(lines) for lines in groups if lines)


def where(module, binding):
    kind, detail = binding
    return f"{module.name}.py:{detail}" if kind == "def" else f"{module.name}.py (import {detail})"


def check_names(modules):
    """Every name the files bind at top level must mean one thing once they share one namespace."""
    seen = {}  # name -> (module, binding)
    for module in modules:
        for name, binding in module.bindings().items():
            if name in seen and not (binding[0] == "import" and seen[name][1] == binding):
                raise BundleError(f"top-level name {name!r} is bound in both {where(*seen[name])} and "
                                  f"{where(module, binding)}; pasted into one train.py one would overwrite the "
                                  f"other, so rename one of them.")
            seen.setdefault(name, (module, binding))
    names = {module.name: module for module in modules}
    for module in modules:
        for local, nodes in module.local.items():
            for node in nodes:
                if isinstance(node, ast.Import):
                    raise BundleError(f"{module.name}.py:{node.lineno} has `import {local}`; write "
                                      f"`from {local} import ...` so the pasted names can stand in.")
                for alias in node.names:
                    if alias.name == "*":
                        raise BundleError(f"{module.name}.py:{node.lineno} has `from {local} import *`; name "
                                          f"the imports so clashes can be checked.")
                    if alias.name not in names[local].bindings():
                        raise BundleError(f"{module.name}.py:{node.lineno} imports {alias.name} from {local}.py, "
                                          f"which does not define it at top level.")
    for module in modules[:-1]:  # a pasted module would see train.py's values of these
        for node in ast.walk(ast.Module(module.statements, [])):
            if isinstance(node, ast.Name) and node.id in ("__name__", "__doc__"):
                raise BundleError(f"{module.name}.py:{node.lineno} reads {node.id}, which is train.py's once "
                                  f"pasted; avoid it outside the main block.")


def bundle_source(src_dir):
    """The text of the self-contained train.py."""
    modules = paste_order(pathlib.Path(src_dir))
    check_names(modules)
    train, pasted = modules[-1], modules[:-1]
    # train.py's docstring (argparse shows it) and leading comments stay first, then one import block
    first_import = train.imports[0].lineno if train.imports else len(train.text.splitlines()) + 1
    head = squeeze_blank_lines(train.text.splitlines()[:first_import - 1])
    names = ", ".join(f"{m.name}.py" for m in pasted)
    top = "\n".join([f"# Generated by bundle.py from train.py, {names}; edit those, not this file."] + head)
    parts = [top + "\n" + merged_imports(modules)]
    for module in pasted:
        header = f"# ---- {module.name}.py, pasted by bundle.py (its docstring, imports and __main__ block dropped)"
        parts.append("\n".join([header] + module.alias_lines() + module.body()))
    parts.append("\n".join(["# ---- train.py"] + train.alias_lines() + train.body(start=first_import)))
    source = "\n\n\n".join(parts) + "\n"
    verify(source, src_dir)
    return source


def verify(source, src_dir):
    """The output must compile and import no repo module but model."""
    try:
        compile(source, "train.py", "exec")
    except SyntaxError as e:
        raise BundleError(f"bundle.py produced a train.py that does not compile: {e}") from None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            roots = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for root in (r.split(".")[0] for r in roots):
                if root != SHIPPED and (pathlib.Path(src_dir) / f"{root}.py").is_file():
                    raise BundleError(f"the bundled train.py still imports {root} (line {node.lineno}).")


def bundle_files(src_dir):
    """{file name: bytes} of the submission."""
    src_dir = pathlib.Path(src_dir)
    model = Module(src_dir / f"{SHIPPED}.py", src_dir, pasted=False)
    if model.local:
        raise BundleError(f"{SHIPPED}.py imports {', '.join(model.local)}, but the organizers import it alone.")
    requirements = "".join(f"{name}\n" for name in REQUIREMENTS.values())
    return {f"{SHIPPED}.py": (src_dir / f"{SHIPPED}.py").read_bytes(),
            "train.py": bundle_source(src_dir).encode(),
            "requirements.txt": requirements.encode()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder to write the submission to (created if missing)")
    parser.add_argument("--check", action="store_true", help="compare OUT_DIR with a fresh bundle, write nothing")
    parser.add_argument("--src", default=pathlib.Path(__file__).resolve().parent, type=pathlib.Path,
                        help="the repo folder holding train.py and model.py (default: this file's folder)")
    args = parser.parse_args(argv)
    for name in ("train.py", f"{SHIPPED}.py"):
        if not (args.src / name).is_file():
            sys.exit(f"error: --src {args.src} has no {name}.")
    try:
        files = bundle_files(args.src)
    except BundleError as e:
        sys.exit(f"error: {e}")
    out = pathlib.Path(args.out_dir)
    if args.check:
        stale = [name for name, data in files.items()
                 if not (out / name).is_file() or (out / name).read_bytes() != data]
        if stale:
            sys.exit(f"{out} is stale ({', '.join(stale)} differ from a fresh bundle); run python bundle.py {out}")
        print(f"{out} matches a fresh bundle of {args.src}")
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)
    print(f"wrote {', '.join(files)} to {out}")


if __name__ == "__main__":
    main()

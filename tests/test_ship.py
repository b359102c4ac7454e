"""Tests for bundle.py and eval.py: the bundled submission runs alone and trains exactly like the repo; eval.py's
numbers are the model's own; HellaSwag picks known answers; clashing names stop the bundle."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import bundle  # noqa: E402
import eval as eval_py  # noqa: E402
from eval import load_checkpoint  # noqa: E402  (the organizers' snippet, verbatim)
from synthetic import write_synthetic  # noqa: E402
from model import get_model  # noqa: E402
from conftest import bind_mount, train_tokenizer  # noqa: E402

torch.set_num_threads(1)
REPO_MODULES = {path.stem for path in REPO.glob("*.py")} - {"model"}
# Runs a script with the given modules unimportable: an editable install (as in CI) would otherwise let a
# forgotten `import data` succeed in the submission folder.
ISOLATED = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked: the script must run without it")
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# 2 micro-steps of 4 windows per optimizer step: accumulation is exercised too
TINY = (
    "--seq_len 32 --batch_size 4 --micro_batch 4 --batch_tokens 256 --n_layer 2 --n_head 2 --n_embd 64 "
    "--val_tokens 4096 --vocab_size 1024"
).split()


def run(args, cwd, blocked=()):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"  # two cores, shared with other test runs
    prefix = [sys.executable] + (["-c", ISOLATED.format(blocked=sorted(blocked))] if blocked else [])
    done = subprocess.run(
        prefix + [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def imported_roots(source):
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    return roots


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """Event-format synthetic data: two chunk files; train.py's validation is the last 4096 tokens of the second."""
    folder = tmp_path_factory.mktemp("tokens")
    write_synthetic(folder, 40_000, chunk_tokens=20_000, vocab_size=1024, n_states=512)
    return folder


@pytest.fixture(scope="module")
def submission(tmp_path_factory):
    out = tmp_path_factory.mktemp("submission")
    bundle.main([str(out)])
    return out


# ----------------------------------------------------------------------------- bundle.py


def test_bundle_holds_model_train_requirements_and_no_repo_imports(submission):
    assert sorted(p.name for p in submission.iterdir()) == ["model.py", "requirements.txt", "train.py"]
    assert (submission / "model.py").read_bytes() == (REPO / "model.py").read_bytes()
    requirements = (submission / "requirements.txt").read_text().splitlines()
    assert [line for line in requirements if not line.startswith("#")] == ["torch>=2.6", "numpy", "tqdm"]
    assert "install torch>=2.10" in requirements[0]  # what a B300 needs, said above the floor
    source = (submission / "train.py").read_text()
    reached, todo = set(), ["train"]  # the repo modules train.py imports, directly or through each other
    while todo:
        local = imported_roots((REPO / f"{todo.pop()}.py").read_text()) & REPO_MODULES
        todo += sorted(local - reached)
        reached |= local
    assert set(bundle.PASTED) == reached - {"train"}  # each one pasted, none that a run does not import
    for i, name in enumerate(bundle.PASTED):  # each after the modules it imports: their definitions run first
        assert imported_roots((REPO / f"{name}.py").read_text()) & REPO_MODULES <= set(bundle.PASTED[:i]), name
    for name in [*bundle.PASTED, "train"]:  # each section opens with the line saying what it is for
        assert re.search(rf"^# ---- {name}\.py: \w", source, re.M), name
    assert "model" in imported_roots(source) and not imported_roots(source) & REPO_MODULES
    for name in ("class BatchLoader", "class Muon", "class Clock", "def launch", "def save_checkpoint"):
        assert re.search(rf"^{name}\b", source, re.M), name  # what a run reaches is there
    for name in ("def write_synthetic", "def _cli_check", "def _cli_bench"):
        assert not re.search(rf"^{name}\b", source, re.M), name  # what no run reaches is not
    assert "# Distributed contract (torch.distributed with world_size > 1, NCCL or gloo):" in source
    assert source.count('if __name__ == "__main__":') == 1
    assert ast.get_docstring(ast.parse(source)) == ast.get_docstring(ast.parse((REPO / "train.py").read_text()))
    run(["bundle.py", submission, "--check"], cwd=REPO)


@pytest.mark.slow
def test_bundled_train_runs_alone_with_organizer_flags_then_eval_py_scores_it(submission, token_dir, tmp_path):
    submission = shutil.copytree(submission, tmp_path / "submission")
    organizer_flags = (
        "--checkpoint_path checkpoint.pt --seq_len 32 --batch_size 4 --grad_accum_steps 2 --max_steps 5000 "
        "--time_limit_min 0.1 --n_layer 2 --n_head 2 --n_embd 64 --val_tokens 4096 --vocab_size 1024"
    ).split()
    out = run(["train.py", "--data_dir", token_dir, *organizer_flags], cwd=submission, blocked=REPO_MODULES)
    summary = metrics(submission / "metrics.jsonl")[-1]
    assert summary["stop_reason"] == "time_limit" and summary["steps"] > 0, out
    model, ckpt = load_checkpoint(submission / "checkpoint.pt")
    assert ckpt["step"] == summary["steps"] and model.config.n_embd == 64

    # the organizers' view: a folder with model.py and eval.py only
    organizer = tmp_path / "organizer"
    organizer.mkdir()
    (organizer / "model.py").write_bytes((submission / "model.py").read_bytes())
    (organizer / "eval.py").write_bytes((REPO / "eval.py").read_bytes())
    out = run(
        ["eval.py", submission / "checkpoint.pt", "--data", token_dir, "--max_tokens", "4096", "--batch_size", "5"],
        cwd=organizer,
        blocked=REPO_MODULES | {"sentencepiece"},
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["seq_len"] == 32 and result["windows"] == 4096 // 33
    assert "last 4,096 tokens of" in result["data"] and result["data"].endswith("chunk_0002.bin")
    # folder mode scores train.py's held-out range, so it reproduces train.py's final validation loss
    assert result["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-5)
    assert result["bits_per_token"] == pytest.approx(result["val_loss"] / np.log(2))
    assert result["val_loss"] < np.log(1024) - 1  # it learned the chain


@pytest.mark.slow
def test_bundled_train_matches_repo_train_step_for_step(submission, token_dir, tmp_path):
    flags = ["--data_dir", token_dir, "--max_steps", "4", "--time_limit_min", "60", *TINY]
    (tmp_path / "repo").mkdir()
    (tmp_path / "bundle").mkdir()
    run([REPO / "train.py", "--checkpoint_path", tmp_path / "repo" / "c.pt", *flags], cwd=tmp_path / "repo")
    run(
        [submission / "train.py", "--checkpoint_path", tmp_path / "bundle" / "c.pt", *flags],
        cwd=submission,
        blocked=REPO_MODULES,
    )
    repo, _ = load_checkpoint(tmp_path / "repo" / "c.pt")
    bundled, ckpt = load_checkpoint(tmp_path / "bundle" / "c.pt")
    assert ckpt["step"] == 4
    init = get_model(ckpt["config"]).state_dict()
    repo_state, bundled_state = repo.state_dict(), bundled.state_dict()
    assert any(not torch.equal(init[k], repo_state[k]) for k in init)  # training moved the weights
    for key, value in repo_state.items():
        assert torch.equal(value, bundled_state[key]), key

    def timeless(rows):  # what the clock (and the plan's measured matmul rate) does not decide
        kept = [
            {k: v for k, v in row.items() if not k.endswith(("_s", "_unix")) and k not in ("mfu", "plan")}
            for row in rows
        ]
        for row in kept:  # a job's seconds too
            row["jobs"] = [{k: v for k, v in job.items() if k != "train_s"} for job in row.get("jobs", [])]
        return kept

    assert timeless(metrics(tmp_path / "repo" / "metrics.jsonl")) == timeless(
        metrics(tmp_path / "bundle" / "metrics.jsonl")
    )


def write_project(folder, files):
    folder.mkdir(exist_ok=True)
    files.setdefault("model.py", "def get_model(config):\n    return config\n")
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def test_bundle_imports_read_as_one_sorted_block_stdlib_then_requirements_then_model(submission):
    tree = ast.parse((submission / "train.py").read_text())
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert tree.body[1 : 1 + len(imports)] == imports  # one block, right after the docstring
    modules = [node.names[0].name if isinstance(node, ast.Import) else node.module for node in imports]
    kinds = [0 if m.split(".")[0] in sys.stdlib_module_names else 2 if m == "model" else 1 for m in modules]
    assert kinds == sorted(kinds) and set(kinds) == {0, 1, 2}
    froms = [node.module for node in imports if isinstance(node, ast.ImportFrom)]
    assert len(froms) == len(set(froms))  # one `from X import` line per module, names merged
    for kind in (0, 1):
        lines = [ast.unparse(node) for node, k in zip(imports, kinds) if k == kind]
        assert lines == sorted(lines, key=lambda line: (line.startswith("from"), line))


def test_bundle_keeps_what_train_reaches_merges_imports_and_runs_the_same(tmp_path):
    project = write_project(
        tmp_path / "project",
        {
            "train.py": '''
            """Synthetic trainer."""
            import json
            from model import get_model
            from helpers import scale, WIDTH
            print(json.dumps([get_model({"w": WIDTH}), scale(3)]))
            ''',
            "helpers.py": '''
            """Helpers: the docstring stays, as a comment."""
            import json
            from util import base
            WIDTH = base() * 2
            def scale(x):
                return x * WIDTH
            def unused():
                return json.dumps(0)
            if __name__ == "__main__":
                print("helpers main must not run")
            ''',
            "util.py": "import os\nprint('util side effect')\n\n\ndef base():\n    return 5\n",
        },
    )
    files = bundle.bundle_files(project, pasted=["util", "helpers"])
    source = files["train.py"]
    assert source.count("import json") == 1 and "def unused" not in source and "must not run" not in source
    assert "# Helpers: the docstring stays, as a comment." in source
    assert source.index("def base") < source.index("WIDTH = ") < source.index("def scale")  # dependencies first
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    expected = run(["train.py"], cwd=project)
    assert expected == 'util side effect\n[{"w": 10}, 30]\n'
    assert run(["train.py"], cwd=out) == expected


@pytest.mark.parametrize(
    "files, words",
    [
        (
            {"a.py": "HELPER = 1\ndef f():\n    return HELPER\n", "b.py": "def g():\n    return 2\nHELPER = 2\n"},
            ["'HELPER'", "a.py:1", "b.py:3", "rename one"],
        ),
        (
            {"a.py": "def f():\n    return 1\ndef main():\n    pass\n", "b.py": "def g():\n    return 2\n"},
            ["'main'", "a.py:3", "train.py:5"],
        ),
    ],
)
def test_bundle_refuses_clashing_top_level_names(tmp_path, files, words):
    project = write_project(
        tmp_path / "p",
        {"train.py": "from a import f\nfrom b import g\n\n\ndef main():\n    print(f(), g())\n", **files},
    )
    with pytest.raises(bundle.BundleError) as error:
        bundle.bundle_files(project, pasted=["a", "b"])
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize(
    "train, words",
    [("import a\n", "imports a pasted module whole"), ("import sqlite3, requests\nfrom a import f\n", "REQUIREMENTS")],
)
def test_bundle_refuses_imports_it_cannot_paste(tmp_path, train, words):
    project = write_project(tmp_path / "p", {"train.py": train, "a.py": "def f():\n    return 1\n"})
    with pytest.raises(bundle.BundleError, match=words):
        bundle.bundle_files(project, pasted=["a"])


def test_each_name_is_imported_from_its_owner_and_no_module_imports_itself_back():
    """No re-export shims (`from data import Deal`, Deal being shards.py's) and no import circle among the
    repo's modules (a CLI imports its library, never the reverse), imports inside functions included."""
    trees = {path.stem: ast.parse(path.read_text()) for path in REPO.glob("*.py")}
    defined = {name: {n for node in tree.body for n in bundle.bound_names(node)} for name, tree in trees.items()}
    sources = [*REPO.glob("*.py"), *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py")]
    borrowed = [
        f"{path.name}:{node.lineno} from {node.module} import {alias.name}"
        for path in sources
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module in trees
        for alias in node.names
        if alias.name not in defined[node.module]
    ]
    assert not borrowed, borrowed
    needs = {name: imported_roots(ast.unparse(tree)) & set(trees) - {name} for name, tree in trees.items()}
    for start in needs:  # every module reachable from start; start among them is a circle
        reached, todo = set(), list(needs[start])
        while todo:
            if (name := todo.pop()) not in reached:
                reached.add(name)
                todo += needs[name]
        assert start not in reached, f"{start}.py imports itself back through {sorted(reached)}"


# ----------------------------------------------------------------------------- eval.py


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A small model with every weight random (the zero-initialised head would give ln(V) on any tokens)."""
    torch.manual_seed(0)
    config = {"vocab_size": 200, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
    model = get_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "config": config, "step": 7}, path)
    return path


def direct_loss(path, tokens, seq_len):
    """The model's forward loss on all disjoint windows at once, computed without eval.py."""
    model, _ = load_checkpoint(path)
    n = len(tokens) // (seq_len + 1)
    windows = torch.from_numpy(tokens[: n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1)
    with torch.no_grad():
        return model(windows[:, :-1], windows[:, 1:])[1].item()


def test_eval_loss_equals_the_model_forward_loss_on_the_same_windows(random_checkpoint, tmp_path):
    rng = np.random.default_rng(0)
    # a repeating tail: few distinct contexts, so its loss is far from a random stretch's
    head, tail, val = rng.integers(0, 200, 1000), np.tile(rng.integers(0, 200, 5), 60), rng.integers(0, 200, 400)
    folder = tmp_path / "tokens"
    folder.mkdir()
    rng.integers(0, 200, 500).astype("<u2").tofile(folder / "chunk_0001.bin")
    np.concatenate([head, tail]).astype("<u2").tofile(folder / "chunk_0002.bin")

    def evaluate(data, *flags):
        return eval_py.main(
            [
                str(random_checkpoint),
                "--data",
                str(data),
                "--max_tokens",
                "300",
                "--device",
                "cpu",
                "--batch_size",
                "3",
                *flags,
            ]
        )

    result = evaluate(folder)  # no val.bin: the last 300 tokens of the last chunk
    assert result["windows"] == 300 // 17 and result["seq_len"] == 16 and result["step"] == 7
    assert result["val_loss"] == pytest.approx(direct_loss(random_checkpoint, tail, 16), abs=1e-5)
    assert abs(direct_loss(random_checkpoint, head, 16) - result["val_loss"]) > 1e-2  # which tokens matters

    result = evaluate(folder / "chunk_0002.bin", "--seq_len", "9")  # a file: its first tokens
    assert result["windows"] == 30 and result["seq_len"] == 9
    assert result["val_loss"] == pytest.approx(direct_loss(random_checkpoint, head[:300], 9), abs=1e-5)

    val.astype("<u2").tofile(folder / "val.bin")  # a folder with val.bin: that file
    result = evaluate(folder)
    assert result["val_loss"] == pytest.approx(direct_loss(random_checkpoint, val[:300], 16), abs=1e-5)
    assert result["bits_per_token"] == pytest.approx(result["val_loss"] / np.log(2), rel=1e-12)


def test_eval_imports_model_only():
    assert imported_roots((REPO / "eval.py").read_text()) & (REPO_MODULES | {"model"}) == {"model"}


def test_hellaswag_without_sentencepiece_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
    with pytest.raises(ValueError, match="pip install sentencepiece"):
        eval_py.load_tokenizer("tokenizer.model", 32000)


class NextIsPlusOne(torch.nn.Module):
    """Stub LM: after token t it puts logit 4 on t + 1 and 0 elsewhere, so every log-prob is known in closed form."""

    vocab = 50

    def forward(self, idx, targets=None):
        return 4.0 * torch.nn.functional.one_hot((idx + 1) % self.vocab, self.vocab).float(), None


HIT = 4.0 - np.log(np.exp(4.0) + NextIsPlusOne.vocab - 1)  # log p of the predicted token
MISS = -np.log(np.exp(4.0) + NextIsPlusOne.vocab - 1)


def test_ending_logprobs_score_each_ending_token_given_everything_before_it():
    endings = [[6, 7, 8], [7, 8], [9, 10, 11, 20], [6]]  # ragged, so padding is exercised
    scores = eval_py.ending_logprobs(NextIsPlusOne(), [3, 4, 5], endings, "cpu", max_len=16)
    expected = [(3 * HIT, 3), (MISS + HIT, 2), (MISS + 2 * HIT + MISS, 4), (HIT, 1)]
    for (total, count), (want_total, want_count) in zip(scores, expected):
        assert count == want_count and total == pytest.approx(want_total, abs=1e-5)
    # a short window drops context from the left, never the ending
    assert eval_py.ending_logprobs(NextIsPlusOne(), [3, 4, 5], [[6, 7, 8]], "cpu", max_len=3)[0][0] == pytest.approx(
        3 * HIT, abs=1e-5
    )
    with pytest.raises(ValueError, match="every ending"):
        eval_py.ending_logprobs(NextIsPlusOne(), [3, 4, 5], [[6, 7, 8]], "cpu", max_len=2)


class WordTokenizer:
    """Stub SentencePiece: one id per word, given by the word itself, BOS = 1."""

    def bos_id(self):
        return 1

    def encode(self, text):
        return [self.encode(t) for t in text] if isinstance(text, list) else [int(w) for w in text.split()]


def test_hellaswag_acc_takes_the_highest_sum_and_acc_norm_the_highest_mean():
    items = [
        ("3 4 5", ["6 7 8", "9", "6 7 30", "40 41"], 0),  # all hits beats everything: both right
        ("3 4 5", ["20", "6 7 8 9 30"], 1),  # 1 miss (best sum) vs 4 hits + 1 miss (best mean): only acc_norm right
        ("10 11", ["30", "12 13 14 15 16 17 18 40"], 0),  # the same trade-off: only acc right
    ]
    result = eval_py.hellaswag(NextIsPlusOne(), items, WordTokenizer(), "cpu", max_len=32)
    assert result == {"hellaswag_acc": 2 / 3, "hellaswag_acc_norm": 2 / 3, "hellaswag_examples": 3}
    first = [(context, endings, 0) for context, endings, _ in items]  # what acc picks everywhere
    result = eval_py.hellaswag(NextIsPlusOne(), first, WordTokenizer(), "cpu", max_len=32)
    assert (result["hellaswag_acc"], result["hellaswag_acc_norm"]) == (1.0, 1 / 3)


SENTENCES = [
    "the red fox jumps over the lazy dog near the quiet river",
    "a small boat sails across the wide lake under grey clouds",
    "my old neighbour bakes fresh bread every sunday morning",
    "two young students solve hard puzzles in the library at night",
    "the tall chef slices ripe tomatoes for a summer salad",
    "heavy rain floods the narrow streets of the ancient town",
    "an orange cat sleeps on the warm windowsill all afternoon",
    "the brave pilot lands the plane safely despite strong winds",
]


def test_hellaswag_end_to_end_with_a_real_sentencepiece_model(tmp_path):
    """A tiny GPT memorises eight sentences; each context is a sentence's first half and the endings are second
    halves of four sentences. Only a model read with the context in the right place knows which one follows."""
    model_file, tokenizer = train_tokenizer(tmp_path, SENTENCES, vocab_size=120)
    docs = [[1] + tokenizer.encode(s) for s in SENTENCES]  # BOS-led documents, as in the event data
    x = torch.zeros(len(docs), max(map(len, docs)), dtype=torch.int64)
    y = torch.full_like(x, -100)  # cross_entropy skips the padding
    for i, doc in enumerate(docs):
        x[i, : len(doc)], y[i, : len(doc) - 1] = torch.tensor(doc), torch.tensor(doc[1:])
    torch.manual_seed(0)
    config = {"vocab_size": 128, "seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 64}
    model = get_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(x, y)[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "config": config}, tmp_path / "checkpoint.pt")

    halves = [s.split() for s in SENTENCES]
    halves = [(" ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2 :])) for w in halves]
    with open(tmp_path / "hellaswag.jsonl", "w") as file:
        for i, (context, _) in enumerate(halves):
            label = i % 4
            others = [halves[(i + k) % len(halves)][1] for k in (1, 3, 5)]
            endings = others[:label] + [halves[i][1]] + others[label:]
            row = (
                {"ctx": context, "endings": endings, "label": label}
                if i % 2
                else {
                    "ctx_a": context.split(" ", 1)[0],
                    "ctx_b": context.split(" ", 1)[1],
                    "endings": endings,
                    "label": label,
                }
            )
            file.write(json.dumps(row) + "\n")
    np.concatenate(docs).astype("<u2").tofile(tmp_path / "val.bin")

    result = eval_py.main(
        [
            str(tmp_path / "checkpoint.pt"),
            "--data",
            str(tmp_path / "val.bin"),
            "--device",
            "cpu",
            "--hellaswag",
            str(tmp_path / "hellaswag.jsonl"),
            "--tokenizer",
            str(model_file),
        ]
    )
    assert result["hellaswag_examples"] == 8
    assert result["hellaswag_acc"] == 1.0 and result["hellaswag_acc_norm"] == 1.0


# ----------------------------------------------------------------------------- bundle.py's OUT_DIR


def source_copy(folder):
    """The repo's modules copied into folder: the --src of cases that, gone wrong, would overwrite their sources."""
    folder.mkdir()
    for path in REPO.glob("*.py"):
        shutil.copy(path, folder)
    return folder


def snapshot(folder):
    """Every path under folder, with the bytes of the files: what a refused bundle must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize(
    "cwd, out_dir, src, message",
    [
        (".", "src", "src", "OUT_DIR src would overwrite SRC/model.py, a source bundle.py reads"),
        ("src", ".", ".", "OUT_DIR . would overwrite SRC/model.py"),
        ("src", "", ".", "OUT_DIR is empty"),  # "" would be the working folder, here the sources
        (".", "link_to_src", "src", "OUT_DIR link_to_src would overwrite SRC/model.py"),
        (".", "src", "link_to_src", "OUT_DIR src would overwrite SRC/model.py"),
        (".", "linked_train", "src", "OUT_DIR linked_train would overwrite SRC/train.py"),
        (".", "hard_linked_train", "src", "OUT_DIR hard_linked_train would overwrite SRC/train.py"),
        (".", "a_file", "src", "OUT_DIR a_file is a file, not a folder"),
        (".", "a_file/sub", "src", "OUT_DIR a_file/sub is under the file TMP/a_file, not a folder"),
        (".", "holds_a_folder", "src", "OUT_DIR holds_a_folder holds model.py as a folder"),
        (".", "out", "nowhere", "--src nowhere lacks checkpoint.py, clock.py"),
    ],
)
def test_bundle_refuses_an_out_dir_that_is_not_a_separate_folder(
    tmp_path, monkeypatch, capsys, cwd, out_dir, src, message
):
    source_copy(tmp_path / "src")
    (tmp_path / "link_to_src").symlink_to(tmp_path / "src")
    (tmp_path / "linked_train").mkdir()
    (tmp_path / "linked_train" / "train.py").symlink_to(tmp_path / "src" / "train.py")
    (tmp_path / "hard_linked_train").mkdir()
    os.link(tmp_path / "src" / "train.py", tmp_path / "hard_linked_train" / "train.py")  # a path check passes it
    (tmp_path / "holds_a_folder" / "model.py").mkdir(parents=True)
    (tmp_path / "a_file").write_text("not a folder\n")
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path / cwd)
    with pytest.raises(SystemExit) as exit_:
        bundle.main([out_dir, "--src", src])
    err = capsys.readouterr().err.strip().splitlines()
    message = message.replace("SRC", str((tmp_path / "src").resolve())).replace("TMP", str(tmp_path))
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert snapshot(tmp_path) == before  # refused before anything was written


def test_a_bind_mount_of_the_source_is_the_source_to_bundle_too(tmp_path, capsys):
    src = source_copy(tmp_path / "src")
    with bind_mount(src, tmp_path / "bound"):
        before = snapshot(src)
        with pytest.raises(SystemExit) as exit_:
            bundle.main([str(tmp_path / "bound"), "--src", str(src)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and err == [
            f"error: OUT_DIR {tmp_path / 'bound'} would overwrite {src.resolve() / 'model.py'}, a source bundle.py "
            f"reads; give a separate folder."
        ]
        assert snapshot(src) == before


def test_a_link_in_out_dir_is_replaced_not_written_through(tmp_path):
    src = source_copy(tmp_path / "src")
    (tmp_path / "notes.txt").write_text("a file of the user's, not a source\n")
    (tmp_path / "unrelated.txt").write_text("another\n")
    out = tmp_path / "out"
    out.mkdir()
    os.link(tmp_path / "notes.txt", out / "train.py")
    (out / "model.py").symlink_to(tmp_path / "unrelated.txt")
    (out / ".requirements.txt.bundling").symlink_to(tmp_path / "unrelated.txt")  # a stale temporary name
    bundle.main([str(out), "--src", str(src)])
    assert (tmp_path / "notes.txt").read_text() == "a file of the user's, not a source\n"
    assert (tmp_path / "unrelated.txt").read_text() == "another\n"
    assert (out / "model.py").read_bytes() == (src / "model.py").read_bytes() and not (out / "model.py").is_symlink()
    assert sorted(p.name for p in out.iterdir()) == ["model.py", "requirements.txt", "train.py"]
    bundle.main([str(out), "--src", str(src), "--check"])


def test_bundle_writes_into_a_new_or_an_existing_separate_folder_and_checks_it(tmp_path, capsys):
    src = source_copy(tmp_path / "src")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "train.py").write_text("a stale bundle\n")
    for out in (tmp_path / "new" / "deep", tmp_path / "old", src / "submission"):  # a subfolder of the repo too
        bundle.main([str(out), "--src", str(src)])
        assert (out / "model.py").read_bytes() == (src / "model.py").read_bytes()
        bundle.main([str(out), "--src", str(src), "--check"])
        assert capsys.readouterr().out.strip().endswith(f"{out} is up to date")

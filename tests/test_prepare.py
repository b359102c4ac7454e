"""Tests for prepare.py and `python data_cli.py prepare`: text, JSON lines and Parquet tokenized with a SentencePiece
or a Hugging Face tokenizer trained here, the same bytes for any worker count, every document whole in training or
validation and decoding back to its text, and bad input refused in one sentence with nothing left behind."""

import json
import random

import numpy as np
import pytest

import data_cli
import prepare
from config import parse_args
from conftest import train_tokenizer
from data import load_token_data
from eval import load_tokenizer
from config import resolve
from windows import token_layout

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings and queens".split()


def corpus(n_docs, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) for _ in range(n_docs)]


def hf_tokenizer(folder, texts, extra_tokens=0):
    """A byte-level BPE tokenizer.json trained on texts (<|endoftext|> = 0, GPT-2's document marker, is its BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(texts, trainer)
    if extra_tokens:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """JSON lines, a text file (documents between blank lines) and a Parquet file, and both kinds of tokenizer."""
    import pyarrow
    import pyarrow.parquet

    folder = tmp_path_factory.mktemp("inputs")
    docs = corpus(900)
    with open(folder / "a.jsonl", "w") as file:
        for i, doc in enumerate(docs[:500]):
            file.write(json.dumps({"id": i, "content": doc}) + "\n")
    (folder / "b.txt").write_text("\n\n".join(docs[500:700]) + "\n")
    pyarrow.parquet.write_table(pyarrow.table({"content": docs[700:]}), folder / "c.parquet", row_group_size=64)
    files = [folder / "a.jsonl", folder / "b.txt", folder / "c.parquet"]
    spm, _ = train_tokenizer(folder, docs[:300], 300)
    return {"docs": docs, "files": files, "sentencepiece": spm, "tokenizers": hf_tokenizer(folder, docs[:300])}


OPTIONS = prepare.Options(
    field="content", column="content", text_docs="blank", chunk_tokens=4000, val_tokens=3000, val_every=10
)


def split_documents(ids, marker):
    """The documents of a token stream: from each marker to the next."""
    starts = np.flatnonzero(ids == marker)
    assert len(starts) and starts[0] == 0
    return [ids[a + 1 : b].tolist() for a, b in zip(starts, [*starts[1:], len(ids)])]


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizers"])
def test_prepare_writes_the_same_bytes_for_any_worker_count_and_every_document_whole_once(inputs, tmp_path, kind):
    outs = {}
    for workers in (1, 2):
        options = prepare.Options(**{**OPTIONS.__dict__, "workers": workers})
        outs[workers] = tmp_path / f"w{workers}" / "out"
        meta = prepare.prepare(inputs["files"], inputs[kind], outs[workers], options)
    names = sorted(p.name for p in outs[1].iterdir())
    assert names == sorted(p.name for p in outs[2].iterdir()) and "val.bin" in names and "chunk_0002.bin" in names
    for name in names:
        one, two = (outs[1] / name).read_bytes(), (outs[2] / name).read_bytes()
        assert one == two if name != "meta.json" else one.replace(b"/w1/", b"/w2/") == two, name
    tokenizer = load_tokenizer(inputs[kind])
    marker = meta["doc_marker"]
    assert marker == tokenizer.bos_id() == {"sentencepiece": 1, "tokenizers": 0}[kind]
    chunks = [np.fromfile(outs[2] / f["name"], dtype="<u2") for f in meta["files"]]
    assert [len(c) for c in chunks[:-1]] == [4000] * (len(chunks) - 1)  # documents run on across chunks
    train = split_documents(np.concatenate(chunks), marker)
    val = split_documents(np.fromfile(outs[2] / "val.bin", dtype="<u2"), marker)
    docs = inputs["docs"]
    # every 10th document, whole, until val.bin holds 3,000 ids; all the others, whole and in order, for training
    val_numbers = list(range(0, 10 * len(val), 10))
    assert [tokenizer.decode(ids) for ids in val] == [docs[i] for i in val_numbers]
    assert [tokenizer.decode(ids) for ids in train] == [doc for i, doc in enumerate(docs) if i not in val_numbers]
    assert sum(map(len, val)) + len(val) >= 3000 > sum(map(len, val[:-1])) + len(val) - 1
    assert meta["documents"] == {"train": len(train), "val": len(val), "empty": 0}
    assert [s["documents"] for s in meta["sources"]] == [500, 200, 200]
    assert meta["tokens"]["train"] == sum(map(len, chunks)) and meta["tokenizer"]["ids"] == tokenizer.get_piece_size()
    # train.py's flags from meta.json read the folder with the marker and the held-out file as written
    hp = resolve(parse_args(meta["train_flags"].split())[0], 1)
    loaded = load_token_data(hp.data_dir, hp.vocab_size, 15, 1000, hp.val_file, hp.token_dtype, hp.bos_id)
    assert loaded.bos_id == marker and np.array_equal(loaded.val, np.fromfile(outs[2] / "val.bin", "<u2")[:1000])


def test_prepare_with_headers_and_uint32_writes_the_same_ids_in_llmc_format(inputs, tmp_path):
    raw = prepare.prepare(inputs["files"], inputs["tokenizers"], tmp_path / "raw", OPTIONS)
    options = prepare.Options(**{**OPTIONS.__dict__, "header": True, "token_dtype": "uint32"})
    headed = prepare.prepare(inputs["files"], inputs["tokenizers"], tmp_path / "llmc", options)
    for a, b in zip(raw["files"] + [raw["val_file"]], headed["files"] + [headed["val_file"]]):
        layout = token_layout(tmp_path / "llmc" / b["name"])
        assert layout.name == "llm.c uint32 (magic 20240801)" and layout.count == a["tokens"] == b["tokens"]
        ids = np.fromfile(tmp_path / "llmc" / b["name"], dtype="<u4", offset=1024)
        assert np.array_equal(ids, np.fromfile(tmp_path / "raw" / a["name"], dtype="<u2"))
    assert headed["train_flags"].endswith("--bos_id 0")  # llm.c's uint32 files mean 128000 to --bos_id auto


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        data_cli.main(["prepare", *map(str, argv)])
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def bad_inputs(folder, inputs):
    """Inputs each bad in one way, named by case; a missing field comes late, after chunks have been written."""
    late = [json.dumps({"content": doc}) for doc in inputs["docs"][:400]] + [json.dumps({"title": "no text"})]
    (folder / "late.jsonl").write_text("\n".join(late) + "\n")
    (folder / "not_utf8.txt").write_bytes(b"caf\xe9 au lait\n")
    (folder / "a_folder.txt").mkdir()
    (folder / "table.csv").write_text("text\nhello\n")
    (folder / "empty.txt").write_text("\n \n\n")
    return {
        "missing": [folder / "missing.jsonl"],
        "folder": [folder / "a_folder.txt"],
        "kind": [folder / "table.csv"],
        "late_missing_field": [inputs["files"][1], folder / "late.jsonl"],
        "not_utf8": [folder / "not_utf8.txt"],
        "no_column": [inputs["files"][2]],
        "only_empty": [folder / "empty.txt"],
    }


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "missing.jsonl is not a readable file"),
        ("folder", "holds no"),
        ("kind", "table.csv is none of the kinds prepare reads"),
        ("late_missing_field", "late.jsonl line 401 has no 'content' field holding text"),
        ("not_utf8", "not_utf8.txt is not UTF-8 text"),
        ("no_column", "c.parquet has no 'body' column (--column); it has ['content']"),
        ("big_vocab", "ids, more than uint16 holds (65,536); pass --token_dtype uint32"),
        ("not_a_tokenizer", "is not a Hugging Face tokenizer.json file"),
        ("no_bos", "--doc_marker 999 is not an id or a token"),
        ("used_out", "already holds chunk_0001.bin; prepare never replaces token files"),
        ("only_empty", "the inputs hold no document for training (0 for validation, 0 empty)"),
    ],
)
def test_bad_input_is_one_sentence_exit_2_and_nothing_half_written(inputs, tmp_path, capsys, case, message):
    files = bad_inputs(tmp_path, inputs).get(case, inputs["files"][:1])
    tokenizer = inputs["tokenizers"]
    if case == "big_vocab":
        tokenizer = hf_tokenizer(tmp_path, inputs["docs"][:50], extra_tokens=70_000)
    elif case == "not_a_tokenizer":
        tokenizer = tmp_path / "x.json"
        tokenizer.write_text("{}")
    out = tmp_path / "out"
    if case == "used_out":
        out.mkdir()
        (out / "chunk_0001.bin").write_bytes(b"\1\0" * 100)
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    column = "body" if case == "no_column" else "content"
    flags = ["--field", "content", "--column", column, "--text_docs", "blank", "--chunk_tokens", "500"]
    flags += ["--doc_marker", "999"] if case == "no_bos" else []
    code, err = run_cli([*files, "--tokenizer", tokenizer, "--out", out, *flags, "--workers", "1"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before  # nothing of the run is left


def test_a_failed_write_leaves_no_chunk_under_its_name(inputs, tmp_path, monkeypatch):
    """A write that fails after some chunks (a full disk) removes them all and the temporary file it was writing."""
    real, calls = prepare.os.rename, []

    def fail_third(source, target):
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(source, target)

    monkeypatch.setattr(prepare.os, "rename", fail_third)
    with pytest.raises(ValueError, match=r"could not be written \(No space left on device\); none of it is left"):
        prepare.prepare(inputs["files"], inputs["tokenizers"], tmp_path / "out", OPTIONS)
    assert len(calls) == 3 and not (tmp_path / "out").exists()

"""Tests for the token-file formats: llm.c's headered shards (uint16 and uint32), raw uint32, modded-nanogpt's file
names, the document marker each format implies, and every check and reader (data.py, stage.py, eval.py) on them."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import data_cli
import eval as eval_py
import stage
from config import check_flags, parse_args
from conftest import LONG_BUDGET, ROOT, SHAPE, child_env, epoch0_windows, read_metrics
from data import BatchLoader, check_token_files, find_token_files, load_token_data
from shards import Deal
from windows import HEADER_BYTES, WindowSpec, token_layout

torch.set_num_threads(1)
SEQ = 31
FORMATS = {  # name: (magic, version, dtype) of llm.c's writer
    "uint16": (20240520, 1, "<u2"),
    "uint32": (20240801, 7, "<u4"),
}


def write_llmc(path, ids, token_dtype="uint16", count=None):
    """ids as llm.c writes them: a 256 x int32 header (magic, version, token count), then the ids."""
    magic, version, dtype = FORMATS[token_dtype]
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids).astype(dtype).tobytes())
    return path


def write_raw(path, ids, token_dtype="uint16"):
    np.asarray(ids).astype(FORMATS[token_dtype][2]).tofile(path)
    return path


def documents(n_tokens, marker, top, seed=0):
    """n_tokens ids below top in documents of 50-400 tokens, each opened by marker."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, top, n_tokens)
    starts = np.cumsum(rng.integers(50, 400, n_tokens // 50))
    ids[0], ids[starts[starts < n_tokens]] = marker, marker
    return ids


def folder_of(folder, writer, arrays, token_dtype, names="chunk_{:04d}.bin"):
    folder.mkdir()
    for i, ids in enumerate(arrays):
        writer(folder / names.format(i + 1), ids, token_dtype)
    return folder


@pytest.mark.parametrize("token_dtype, marker, top", [("uint16", 50256, 50257), ("uint32", 128000, 128256)])
def test_each_header_format_reads_the_same_ids_as_raw(tmp_path, token_dtype, marker, top):
    arrays = [documents(20_000, marker, top, seed) for seed in range(3)]
    raw = folder_of(tmp_path / "raw", write_raw, arrays, token_dtype)
    llmc = folder_of(tmp_path / "llmc", write_llmc, arrays, token_dtype)
    assert token_layout(llmc / "chunk_0001.bin").name == f"llm.c {token_dtype} (magic {FORMATS[token_dtype][0]})"
    a = load_token_data(raw, top, SEQ, 3000, token_dtype=token_dtype, bos_id=marker)
    b = load_token_data(llmc, top, SEQ, 3000)  # the header says the dtype, and its marker is --bos_id auto's
    assert b.bos_id == a.bos_id == marker and b.summary["bos_rate"] == a.summary["bos_rate"] > 0
    assert all(np.array_equal(x, y) for x, y in zip(a.train, b.train)) and np.array_equal(a.val, b.val)
    assert b.train[0].dtype == np.dtype(FORMATS[token_dtype][2]) and int(b.train[0].max()) > 65535 * (top > 65536)
    for doc_aligned in (False, True):
        spec = WindowSpec(SEQ, doc_aligned=doc_aligned, bos_id=marker, vocab_size=top)
        with BatchLoader(a.train, spec, 8, Deal(0, 1)) as x, BatchLoader(b.train, spec, 8, Deal(0, 1)) as y:
            windows = epoch0_windows(y)
            assert np.array_equal(epoch0_windows(x), windows) and (windows[:, 0] == marker).all() == doc_aligned
    # eval.py's own copy of the format reads the same tokens, the held-out tail included
    path = llmc / "chunk_0003.bin"
    tokens, where = eval_py.eval_tokens(llmc, 3000)
    assert np.array_equal(tokens.numpy(), a.val) and where == f"last 3,000 tokens of {path}"
    first, _ = eval_py.eval_tokens(path, 500)
    assert np.array_equal(first.numpy(), arrays[2][:500])


@pytest.mark.parametrize("token_dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("change", ["count_above", "count_below", "cut_short"])
def test_a_header_whose_count_disagrees_with_the_file_is_refused(tmp_path, token_dtype, change):
    ids = documents(5000, 1, 1000)
    path = write_llmc(tmp_path / "chunk_0001.bin", ids, token_dtype, count={"count_above": 5001}.get(change, 5000))
    if change == "count_below":
        write_llmc(path, ids, token_dtype, count=4999)
    if change == "cut_short":
        path.write_bytes(path.read_bytes()[:-6])
    with pytest.raises(ValueError, match=r"header says [\d,]+ tokens .* but the file holds [\d,]+ bytes"):
        load_token_data(tmp_path, 1000, SEQ, 1000)
    with pytest.raises(ValueError, match="does not match its"):
        eval_py.read_tokens(path, 100)
    write_llmc(path, ids, token_dtype)
    header = bytearray(path.read_bytes())
    header[4:8] = (3).to_bytes(4, "little")  # a version llm.c never wrote
    path.write_bytes(bytes(header))
    with pytest.raises(ValueError, match="but not its 1024-byte header of version"):
        load_token_data(tmp_path, 1000, SEQ, 1000)


def test_a_folder_mixing_formats_is_one_sentence_before_the_clock(tmp_path):
    ids = documents(20_000, 1, 1000)
    write_raw(tmp_path / "chunk_0001.bin", ids)
    write_llmc(tmp_path / "chunk_0002.bin", ids)
    with pytest.raises(ValueError, match=r"mix formats: .*chunk_0001.bin is raw uint16, .*chunk_0002.bin is llm.c"):
        load_token_data(tmp_path, 1000, SEQ, 1000)
    args = ["--data_dir", str(tmp_path), "--vocab_size", "1000", *SHAPE, "--seq_len", str(SEQ), "--val_tokens", "999"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "--checkpoint_path", str(tmp_path / "out" / "c.pt")],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1 and "mix formats" in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "c.pt").exists()  # refused before the step-0 save


def test_modded_nanogpt_shards_train_on_their_names_and_their_marker(tmp_path, capsys):
    """fineweb_train_*.bin are the training files of a folder without chunk_*.bin; fineweb_val_*.bin is not one of
    them (it is the --val_file, and eval.py's pick in the folder); <|endoftext|> marks their documents."""
    arrays, names = [documents(20_000, 50256, 50257, seed) for seed in range(2)], "fineweb_train_{:06d}.bin"
    folder = folder_of(tmp_path / "fineweb10B", write_llmc, arrays, "uint16", names)
    val = write_llmc(folder / "fineweb_val_000000.bin", documents(8000, 50256, 50257, 9))
    assert [p.name for p in find_token_files(folder)] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    loaded = load_token_data(folder, 50304, SEQ, 4096, val_file=val)
    assert loaded.bos_id == 50256 and np.array_equal(loaded.val, documents(8000, 50256, 50257, 9)[:4096])
    assert "2 files (llm.c uint16 (magic 20240520))" in loaded.source and "marker id 50256 detected" in loaded.source
    tokens, where = eval_py.eval_tokens(folder, 4096)
    assert where == f"first 4,096 tokens of {val}" and np.array_equal(tokens.numpy(), loaded.val)
    data_cli.main(["check", str(folder), "--vocab_size", "50304", "--seq_len", str(SEQ)])
    out = capsys.readouterr().out
    assert "2 files (llm.c uint16 (magic 20240520))" in out and "(--bos_id) 50256" in out and ": detected" in out
    assert load_token_data(folder, 50304, SEQ, 4096, val_file=val, bos_id=1).bos_id is None  # not their marker


def test_raw_uint32_ids_above_65535_pass_the_checks_and_reach_the_batches(tmp_path):
    ids = documents(30_000, 1, 70_000)
    ids[ids == 1] = 65_536 + 1  # no marker in the data
    write_raw(tmp_path / "chunk_0001.bin", ids, "uint32")
    with pytest.raises(ValueError, match="not a multiple of 4"):
        (tmp_path / "chunk_0002.bin").write_bytes(b"\0" * 6)
        load_token_data(tmp_path, 70_000, SEQ, 1000, token_dtype="uint32")
    (tmp_path / "chunk_0002.bin").unlink()
    with pytest.raises(ValueError, match=r"token id 69999 >= --vocab_size 65536"):  # the same ids, a 64K vocab
        load_token_data(tmp_path, 65_536, SEQ, 1000, token_dtype="uint32")
    loaded = load_token_data(tmp_path, 70_000, SEQ, 1000, token_dtype="uint32")
    with BatchLoader(loaded.train, WindowSpec(SEQ, vocab_size=70_000), 8, Deal(0, 1)) as loader:
        windows = epoch0_windows(loader)
    train = ids[:29_000].astype(np.int64)
    rows = {row.tobytes() for row in train[: len(train) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1)}
    assert windows.max() > 65_535 and len(windows) > 0.95 * len(rows) and all(w.tobytes() in rows for w in windows)
    # read as uint16 (the default) the same file is twice as many small ids: never silently mistaken for uint32
    assert int(load_token_data(tmp_path, 70_000, SEQ, 1000).train[0].max()) < 65_536
    hp, _, _ = parse_args(["--vocab_size", "128256", "--token_dtype", "uint32"])
    check_flags(hp)
    for flags, message in ((["--bos_id", "-1"], "--bos_id must be at least 0"), (["--token_dtype", "int8"], "one of")):
        with pytest.raises(ValueError, match=message):
            check_flags(parse_args(flags)[0])


def test_staging_a_headered_folder_copies_its_headers_and_reads_the_same(tmp_path, monkeypatch):
    arrays = [documents(300_000, 128000, 128256, seed) for seed in range(3)]
    src = folder_of(tmp_path / "src", write_llmc, arrays, "uint32")
    monkeypatch.setattr(stage.socket, "getfqdn", lambda: "n1")
    hp = parse_args(["--seq_len", str(SEQ), "--val_tokens", "1000"])[0]
    stage.stage(src, tmp_path / "dst", 4 * 64 * SEQ, 2, 1.0, ["n1", "n2"], 1, hp)
    dst = tmp_path / "dst"
    assert (dst / "chunk_0001.bin").read_bytes()[:HEADER_BYTES] == (src / "chunk_0001.bin").read_bytes()[:HEADER_BYTES]
    files = find_token_files(dst)
    assert check_token_files(files, 128256, SEQ) == check_token_files(find_token_files(src), 128256, SEQ)
    full, part = load_token_data(src, 128256, SEQ, 1000), load_token_data(dst, 128256, SEQ, 1000)
    assert np.array_equal(full.val, part.val)
    spec = WindowSpec(SEQ, vocab_size=128256)
    with BatchLoader(part.train, spec, 8, Deal(0, 2)) as staged, BatchLoader(full.train, spec, 8, Deal(0, 2)) as whole:
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(next(staged), next(whole)))


@pytest.mark.slow
def test_uint32_ids_above_65535_train_and_evaluate(tmp_path):
    """A vocabulary of 70,000 in raw uint32 files, documents opened by id 69,999: train.py trains on ids above 65,535
    (--token_dtype uint32 --bos_id 69999 --doc_aligned) and eval.py scores them (--token_dtype uint32)."""
    data = folder_of(tmp_path / "data", write_raw, [documents(60_000, 69_999, 70_000, s) for s in range(2)], "uint32")
    val = write_raw(tmp_path / "val.bin", documents(4096, 69_999, 70_000, 7), "uint32")
    checkpoint = tmp_path / "checkpoint.pt"
    args = [*SHAPE, "--seq_len", str(SEQ), "--batch_size", "8", "--batch_tokens", "256", "--max_steps", "6"]
    args += ["--data_dir", str(data), "--val_file", str(val), "--vocab_size", "70000", "--val_tokens", "4096"]
    args += ["--token_dtype", "uint32", "--bos_id", "69999", "--doc_aligned", "--val_eval_tokens", "2048"]
    args += ["--checkpoint_path", str(checkpoint), *LONG_BUDGET]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 files (raw uint32)" in proc.stdout and "marker id 69999 detected" in proc.stdout
    _, val_rows, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 6 and np.isfinite(val_rows[-1]["val_loss"])
    flags = ["--device", "cpu", "--max_tokens", "2048", "--token_dtype", "uint32"]
    result = eval_py.main([str(checkpoint), "--data", str(val), *flags])
    assert result["tokens"] == 64 * SEQ and result["val_loss"] == pytest.approx(val_rows[-1]["val_loss"], rel=1e-4)


def test_a_bad_id_in_a_headered_file_is_named_at_its_token_not_counting_the_header(tmp_path, capfd):
    ids = documents(5000, 1, 1000)
    ids[1234] = 40_000
    path = write_llmc(tmp_path / "chunk_0001.bin", ids)
    train = load_token_data(tmp_path, 50257, SEQ, 0).train
    with BatchLoader(train, WindowSpec(SEQ, vocab_size=1000), 8, Deal(0, 1)) as loader:
        epoch0_windows(loader)
    warning = capfd.readouterr().err.strip().splitlines()[0]
    assert warning.startswith(f"warning: rank 0: {path} at token 1,234 holds id 40000 >= vocab_size 1000"), warning

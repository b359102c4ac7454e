"""Tests for stage.py: a staged folder holds exactly what this node's ranks read, and the loader never reads past it;
staging never writes to its source (by any path to it), replaces stale files, and refuses a bad flag in one sentence."""

import json
import os

import numpy as np
import pytest
import torch

import stage
from data import BatchLoader, check_token_files, find_token_files, load_token_data
from shards import BLOCK_WINDOWS, STAGED_MANIFEST, Deal, block_layout, staged_blocks
from conftest import bind_mount, epoch0_windows, full_windows
from config import parse_args
from windows import WindowSpec

torch.set_num_threads(1)
SEQ, VAL = 15, 1000  # 16-token windows, 1024-token blocks
FLAGS = ["--seq_len", str(SEQ), "--val_tokens", str(VAL)]


@pytest.fixture
def staged(tmp_path, monkeypatch):
    """Files of no token 0 (what an unstaged range reads as), far larger than the check's sample, staged for ranks
    2-3 of 4, 3 blocks each: node 'n2' sorts second."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for i in range(4):
        (np.arange(i, i + 2_000_000) % 65535 + 1).astype("<u2").tofile(src / f"chunk_{i + 1:04d}.bin")
    monkeypatch.setattr(stage.socket, "getfqdn", lambda: "n2")
    tokens = 3 * BLOCK_WINDOWS * SEQ * 4 / 1.5
    stage.stage(src, dst, tokens, 4, 1.5, ["n2", "n1"], 2, parse_args(FLAGS)[0])
    return src, dst


def loader(folder, rank, val_tokens=VAL):
    train = load_token_data(folder, 65536, SEQ, val_tokens).train
    return BatchLoader(train, WindowSpec(SEQ, vocab_size=65536), BLOCK_WINDOWS // 2, Deal(rank, 4))


def test_staged_folder_holds_the_ranks_blocks_validation_and_check_sample(staged):
    src, dst = staged
    manifest = json.loads((dst / STAGED_MANIFEST).read_text())
    assert manifest["ranks"] == [2, 3] and manifest["blocks_per_rank"] == 3
    sizes = [p.stat().st_size for p in find_token_files(src)]
    assert [p.stat().st_size for p in find_token_files(dst)] == sizes
    assert check_token_files(find_token_files(dst), 65536, SEQ) == check_token_files(find_token_files(src), 65536, SEQ)
    full, part = load_token_data(src, 65536, SEQ, VAL), load_token_data(dst, 65536, SEQ, VAL)
    assert np.array_equal(full.val, part.val)
    staged_tokens = sum(np.count_nonzero(np.fromfile(p, dtype="<u2")) for p in find_token_files(dst))
    assert staged_tokens < sum(sizes) // 2 // 2  # well under the whole folder


def test_loader_reads_its_usual_blocks_then_repeats_them_never_a_hole(staged, capfd):
    src, dst = staged
    for rank in (2, 3):
        with loader(dst, rank) as part, loader(src, rank) as full:
            _, start, end = block_layout([len(a) for a in part.arrays], SEQ)
            blocks = staged_blocks(len(start), rank, 4, 0, 3)
            n_staged = int(sum((end[blocks] - start[blocks]) // (SEQ + 1)))  # windows in the 3 staged blocks
            usual = np.concatenate([full_windows(*next(full)) for _ in range(-(-n_staged // full.batch_size))])
            usual = usual[:n_staged]  # what the rank reads from the full folder first
            first = epoch0_windows(part)
            assert np.array_equal(first, usual[: len(first)]) and len(first) > n_staged - part.batch_size
            staged_rows = {row.tobytes() for row in usual}
            for _ in range(4 * n_staged // part.batch_size):  # four more passes over the staged blocks
                assert all(row.all() and row.tobytes() in staged_rows for row in full_windows(*next(part)))
        assert capfd.readouterr().err.count(f"rank {rank} has read all 3 blocks staged for it") == 1


def test_a_manifest_for_other_ranks_or_another_run_is_an_error(staged):
    _, dst = staged
    with pytest.raises(ValueError, match=r"holds the blocks of ranks \[2, 3\], but torchrun made this process rank 0"):
        loader(dst, 0)
    with pytest.raises(ValueError, match="was staged for another run: its lengths differ"):
        loader(dst, 2, val_tokens=2 * VAL)


def test_a_node_not_in_the_list_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(stage.socket, "getfqdn", lambda: "n3")
    with pytest.raises(ValueError, match="this node is 'n3'"):
        stage.stage(tmp_path, tmp_path / "dst", 1000, 4, 1.5, ["n1", "n2"], 2, parse_args(FLAGS)[0])


# ------------------------------------------------------------------------ staging never writes to its source; bad flags


PLAN = json.dumps({"tokens": 20_000, "world_size": 1})


@pytest.fixture
def stage_src(tmp_path, monkeypatch):
    import numpy as np

    import stage

    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (np.arange(i, i + 300_000) % 1000 + 2).astype("<u2").tofile(src / f"chunk_{i + 1:04d}.bin")
    monkeypatch.setattr(stage.socket, "getfqdn", lambda: "n1")
    return src


def run_stage(src, dst, *flags, plan=PLAN):
    import stage

    argv = [str(src), str(dst), "--plan", plan, "--nodes", "n1", "--nproc", "1", *flags]
    try:
        stage.main([*argv, "--", "--seq_len", "15", "--val_tokens", "1000"])
    except SystemExit as e:
        return e.code
    return 0


def same_dir(tmp, src):
    return src


def symlinked_dir(tmp, src):
    (tmp / "local").symlink_to(src)
    return tmp / "local"


def linked_chunks(make_link):
    def make(tmp, src):
        (tmp / "local").mkdir()
        for chunk in src.iterdir():
            make_link(chunk, tmp / "local" / chunk.name)
        return tmp / "local"

    return make


def a_file(tmp, src):
    (tmp / "local").write_text("not a folder")
    return tmp / "local"


STAGE_DESTINATIONS = {
    "the source folder": (same_dir, "is the source folder"),
    "a symlink to the source folder": (symlinked_dir, "is the source folder"),
    "a folder of hard links to the chunks": (linked_chunks(os.link), "is the source file"),
    "a folder of symlinks to the chunks": (linked_chunks(os.symlink), "is the source file"),
    "a file": (a_file, "is a file, not a folder"),
}


@pytest.mark.parametrize("case", STAGE_DESTINATIONS.values(), ids=STAGE_DESTINATIONS.keys())
def test_staging_never_writes_through_to_its_source(tmp_path, stage_src, capsys, case):
    make, words = case
    before = {p.name: p.read_bytes() for p in stage_src.iterdir()}
    assert run_stage(stage_src, make(tmp_path, stage_src)) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in stage_src.iterdir()} == before


def test_a_bind_mount_of_the_source_is_the_source(tmp_path, stage_src, capsys):
    with bind_mount(stage_src, tmp_path / "bound") as bound:
        before = {p.name: p.read_bytes() for p in stage_src.iterdir()}
        assert run_stage(stage_src, bound) == 2
        assert "is the source folder" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in stage_src.iterdir()} == before


STAGE_FLAGS = {
    "plan not JSON": ({"plan": "plan: l2w64 ..."}, "--plan"),
    "plan without tokens": ({"plan": json.dumps({"world_size": 1})}, "--plan"),
    "plan with negative tokens": ({"plan": json.dumps({"tokens": -5, "world_size": 1})}, "--plan"),
    "plan a list": ({"plan": "[1, 2]"}, "--plan"),
    "margin nan": ({"flags": ["--margin", "nan"]}, "--margin"),
    "margin inf": ({"flags": ["--margin", "inf"]}, "--margin"),
    "margin 0": ({"flags": ["--margin", "0"]}, "--margin"),
    "nproc 0": ({"flags": ["--nproc", "0"]}, "--nproc"),
}


@pytest.mark.parametrize("case", STAGE_FLAGS.values(), ids=STAGE_FLAGS.keys())
def test_stage_bad_inputs_are_one_sentence_and_exit_2(tmp_path, stage_src, capsys, case):
    given, words = case
    code = run_stage(stage_src, tmp_path / "dst", *given.get("flags", []), plan=given.get("plan", PLAN))
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def test_staging_replaces_stale_files_and_leaves_no_temporary_one(tmp_path, stage_src, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "chunk_0001.bin").write_bytes(b"stale")
    (dst / ".chunk_0002.bin.staging").write_bytes(b"left by a killed copy")
    assert run_stage(stage_src, dst) == 0
    assert sorted(p.name for p in dst.iterdir()) == ["chunk_0001.bin", "chunk_0002.bin", "staged.json"]
    assert (dst / "chunk_0001.bin").stat().st_size == (stage_src / "chunk_0001.bin").stat().st_size

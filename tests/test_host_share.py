"""The host's share of a step at the event's structure (16 blocks, 96 Muon matrices, the default tables), counted by
bench/host_share.py under a TorchDispatchMode: the ops that launch work per optimizer step and per micro-step stay
few, and nothing on the step's path reads a device value back (a host sync)."""

import argparse
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import host_share  # noqa: E402


@pytest.fixture(scope="module")
def counts():
    args = argparse.Namespace(accum=4, micro_batch=2, seq_len=32, width=64, vocab=256)
    return host_share.count_ops(args), host_share.count_ops(args, cuda_norms=True)


def test_an_optimizer_step_dispatches_a_bounded_number_of_ops_however_many_matrices(counts):
    """One foreach kernel an elementwise op over all 96 matrices, one Newton-Schulz and NorMuon stack an oriented
    shape: ~120 ops, where one matrix at a time made ~820."""
    plain, _ = counts
    assert plain["muon_matrices"] == 96
    assert plain["optimizer_ops"] <= 150, plain["top_optimizer_ops"]


def test_the_eager_glue_between_blocks_is_a_few_launches_a_micro_step(counts):
    """Outside the compiled blocks and the head loss's compiled chunk math: lookups, norms, the hash, the skips; on
    CUDA (the RMS norms one fused kernel each way) at most 30 forward launches and 90 backward."""
    plain, cuda = counts
    assert cuda["glue_forward_ops_per_micro"] <= 30, plain["top_glue_forward_ops"]
    assert cuda["glue_backward_ops_per_micro"] <= 90
    assert plain["glue_forward_ops_per_micro"] <= 35  # the CPU build decomposes each norm into five ops


def test_no_host_sync_on_the_steps_path(counts):
    plain, cuda = counts
    assert plain["host_syncs_per_step"] == 0 and cuda["host_syncs_per_step"] == 0

import pytest
import torch

from autosize import (AUTO_EFFICIENCY, LADDER, TOKENS_PER_PARAM, choose_shape, memory_needed, measure_matmul_rate,
                      pick_shape, shape_config, shape_costs)
from model import get_model

COMMON = dict(efficiency=0.4, world_size=1, budget_s=600.0, vocab_size=32000, seq_len=1024, batch_size=8,
              memory_bytes=1e15, bf16=True, tokens_per_param=20.0)
NAMES = [entry[0] for entry in LADDER]


def pick(**overrides):
    return pick_shape(**{**COMMON, **overrides})[0]


def test_ladder_grows_in_params_and_flops():
    costs = [shape_costs(n, 32000, 1024) for n in NAMES]
    for small, big in zip(costs, costs[1:]):
        assert small["matmul_params"] < big["matmul_params"]
        assert small["block_params"] < big["block_params"]
        assert small["flops_per_token"] < big["flops_per_token"]


def test_costs_match_a_real_model():
    real = get_model({"vocab_size": 512, "seq_len": 64, **shape_config("l4w128")})
    costs = shape_costs("l4w128", 512, 64)
    assert costs["params"] == real.num_params()
    assert costs["flops_per_token"] == real.flops_per_token()


def test_block_params_are_the_blocks_weights():
    for name in NAMES:
        layers, width = shape_config(name)["n_layer"], shape_config(name)["n_embd"]
        block = shape_costs(name, 32000, 1024)["block_params"]
        assert 12 * layers * width ** 2 <= block < 1.01 * 12 * layers * width ** 2  # + per-block scalars


def test_more_compute_never_picks_a_smaller_model():
    base = {"matmul_rate": 1e13, "world_size": 1, "budget_s": 600.0}
    for knob in base:
        picks = []
        for factor in [4.0 ** e for e in range(-6, 9)]:
            picks.append(NAMES.index(pick(**{**base, knob: base[knob] * factor})))
        assert picks == sorted(picks), (knob, picks)
        assert picks[0] < picks[-1], f"{knob}: the pick should move across this range"


def test_deterministic_and_follows_the_ratio_rule():
    name, table = pick_shape(matmul_rate=1e15, **COMMON)
    assert (name, table) == pick_shape(matmul_rate=1e15, **COMMON)
    i = NAMES.index(name)
    assert table[i]["tokens_per_param"] >= COMMON["tokens_per_param"]
    if i + 1 < len(table):
        assert table[i + 1]["tokens_per_param"] < COMMON["tokens_per_param"]
    # a looser ratio can only allow a larger model
    assert NAMES.index(pick(matmul_rate=1e15, tokens_per_param=5.0)) >= i


def test_never_picks_a_shape_that_does_not_fit():
    huge_compute = dict(matmul_rate=1e18, world_size=32)
    assert pick(**huge_compute) == NAMES[-1]
    for limit_name in NAMES[1:-1]:
        config = {"vocab_size": 32000, "seq_len": 1024, **shape_config(limit_name)}
        need = memory_needed(shape_costs(limit_name, 32000, 1024), config, 8, 1024, True)
        name = pick(memory_bytes=need, **huge_compute)
        assert name == limit_name
    with pytest.raises(ValueError, match="fits"):
        pick(memory_bytes=1.0, **huge_compute)


def test_starved_compute_still_picks_the_smallest_shape():
    assert pick(matmul_rate=1.0) == NAMES[0]


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="--model"):
        shape_config("gpt5")


def test_matmul_rate_is_measured():
    rate = measure_matmul_rate(torch.device("cpu"), seconds=0.05)
    assert 1e8 < rate < 1e14


def test_choose_shape_uses_the_device_tables_and_logs_the_pick():
    lines = []
    name, efficiency, ratio = choose_shape(torch.device("cpu"), 1, budget_s=120.0, vocab_size=32000, seq_len=256,
                                           batch_size=8, bf16=False, efficiency=-1.0, tokens_per_param=-1.0,
                                           say=lines.append)
    assert (efficiency, ratio) == (AUTO_EFFICIENCY["cpu"], TOKENS_PER_PARAM["cpu"])
    assert name in NAMES
    assert [line.split()[1].rstrip(":") for line in lines if line.strip().startswith("->")] == [name]
    # explicit values win; a starved ratio admits the largest shape that fits the machine's memory
    name, efficiency, ratio = choose_shape(torch.device("cpu"), 1, budget_s=120.0, vocab_size=32000, seq_len=256,
                                           batch_size=8, bf16=False, efficiency=0.5, tokens_per_param=0.0,
                                           say=lines.append)
    assert (efficiency, ratio) == (0.5, 0.0)
    assert NAMES.index(name) >= NAMES.index("l12w768")

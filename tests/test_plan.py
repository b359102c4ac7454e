"""plan.py: the run plan (shape, tokens per step, micro-batch, forecast), as pure functions."""

import pytest
import torch

import clock as C
import plan as P
from model import get_model

NAMES = [entry[0] for entry in P.LADDER]


def test_event_plan_fits_the_budget_inside_max_steps_and_trains_billions_of_tokens(event_plan):
    plan, table = event_plan()
    assert plan.steps <= C.STEP_HEADROOM * 5000 + 1 and plan.train_s <= 600.0
    assert plan.tokens >= 5e9 and plan.tokens == plan.steps * plan.tokens_per_step
    assert plan.tokens_per_step >= P.MIN_TOKENS_PER_STEP["cuda"]
    assert plan.tokens_per_step == 32 * plan.micro_batch * 1024 * plan.grad_accum_steps
    assert plan.micro_batch * 1024 <= P.MAX_MICRO_TOKENS["cuda"] and plan.micro_batch >= 8
    # the budget is used: the step after the last forecast one would not fit
    assert (plan.steps + 1) * plan.step_s > 600.0


def test_a_loose_step_cap_keeps_the_recipe_minimum(event_plan):
    plan, _ = event_plan(model="l12w768", max_steps=10**9)
    assert plan.tokens_per_step == P.MIN_TOKENS_PER_STEP["cuda"]


def test_a_tight_step_cap_raises_tokens_per_step_and_auto_sizes_for_what_is_trained(event_plan):
    loose, _ = event_plan(max_steps=10**9)
    tight, _ = event_plan(max_steps=500)
    assert tight.tokens_per_step > loose.tokens_per_step and tight.steps <= C.STEP_HEADROOM * 500 + 1
    assert tight.model == loose.model  # the same tokens get trained, so the same size
    # an explicit --batch_tokens is kept: then the step cap binds, fewer tokens are trained, auto picks smaller
    fixed, _ = event_plan(max_steps=500, batch_tokens=524288)
    assert fixed.tokens_per_step == 524288 and fixed.steps == 500
    assert NAMES.index(fixed.model) < NAMES.index(tight.model)


def test_batch_size_is_a_floor_and_an_explicit_micro_batch_is_kept(event_plan):
    plan, _ = event_plan(
        model="l4w128",
        kind="cpu",
        world_size=1,
        seq_len=64,
        batch_size=48,
        max_steps=10**9,
        matmul_rate=1e11,
        efficiency=0.2,
        memory_bytes=1e10,
    )
    assert plan.micro_batch == 48 and plan.tokens_per_step == 48 * 64
    plan, _ = event_plan(
        model="l4w128",
        kind="cpu",
        world_size=2,
        seq_len=16,
        micro_batch=4,
        batch_tokens=256,
        max_steps=10**9,
        matmul_rate=1e11,
        efficiency=0.2,
        memory_bytes=1e10,
    )
    assert (plan.micro_batch, plan.grad_accum_steps, plan.tokens_per_step) == (4, 2, 256)


def test_micro_batch_shrinks_to_fit_memory(event_plan):
    big, _ = event_plan(model="l16w1024")
    costs = P.shape_costs(P.shape_config("l16w1024"), 32000, 1024)
    small_memory = P.memory_needed(costs, P.shape_config("l16w1024"), 4, 1024, True, kind="cuda", world_size=32)
    small, _ = event_plan(model="l16w1024", memory_bytes=small_memory, batch_size=1)
    assert small.micro_batch <= 4 < big.micro_batch and small.fits
    assert small.tokens_per_step >= big.tokens_per_step * 0.9  # the same step, more accumulation


# ----------------------------------------------------------------------------- --model auto


def test_more_compute_never_picks_a_smaller_model(event_plan):
    ranges = {
        "matmul_rate": [2250e12 * 4.0**e for e in range(-10, 3)],
        "budget_s": [600.0 * 4.0**e for e in range(-10, 3)],
        "world_size": [2**e for e in range(0, 11)],
    }
    for knob, values in ranges.items():
        picks = [
            NAMES.index(event_plan(**{knob: value, "world_size": 1 if knob != "world_size" else value})[0].model)
            for value in values
        ]
        assert picks == sorted(picks), (knob, picks)
        assert picks[0] < picks[-1], f"{knob}: the pick should move across this range"


def test_auto_takes_the_largest_shape_meeting_the_ratio_and_never_one_that_does_not_fit(event_plan):
    plan, table = event_plan()
    i = NAMES.index(plan.model)
    assert table[i].tokens_per_param >= 20.0 and table[i + 1].tokens_per_param < 20.0
    costs = P.shape_costs(P.shape_config("l12w768"), 32000, 1024)
    need = P.memory_needed(costs, P.shape_config("l12w768"), 8, 1024, True, kind="cuda", world_size=32)
    assert event_plan(memory_bytes=need)[0].model == "l12w768"
    with pytest.raises(ValueError, match="fits"):
        event_plan(memory_bytes=1.0)
    assert event_plan(matmul_rate=1.0)[0].model == NAMES[0]  # starved compute: the smallest shape


def test_explicit_shapes_and_names_are_planned_as_given(event_plan):
    plan, table = event_plan(shape={"n_layer": 3, "n_head": 2, "n_embd": 64})
    assert (plan.model, plan.n_layer, plan.n_embd, table) == ("custom", 3, 64, [])
    assert event_plan(model="l8w384")[0].model == "l8w384"
    with pytest.raises(ValueError, match="--model"):
        event_plan(model="gpt5")


def test_costs_match_a_model_built_for_real_and_block_params_are_the_blocks():
    shape = P.shape_config("l4w128")
    real = get_model({"vocab_size": 512, "seq_len": 64, **shape})
    costs = P.shape_costs(shape, 512, 64)
    assert costs["params"] == sum(p.numel() for p in real.parameters())
    assert costs["block_params"] == sum(p.numel() for p in real.blocks.parameters())
    assert 12 * 4 * 128**2 <= costs["block_params"] < 1.01 * 12 * 4 * 128**2


def test_flops_per_token_matches_torchs_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model = get_model({"vocab_size": 512, "seq_len": 64, "n_layer": 2, "n_head": 2, "n_embd": 64})
    idx = torch.randint(0, 512, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(idx)[0].sum().backward()
    counted = counter.get_total_flops() / idx.numel()
    # the counter sees every matmul but has no formula for CPU attention: compare all but the 6 L C T attention term
    assert model.flops_per_token(64) - 6 * 2 * 64 * 64 == pytest.approx(counted, rel=1e-3)


def test_matmul_rate_predicts_the_time_of_a_matmul_workload():
    import time

    rate = P.measure_matmul_rate(torch.device("cpu"), seconds=0.2)
    a = torch.randn(384, 384)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    predicted = 20 * 2 * 384**3 / rate
    assert 0.25 < (time.perf_counter() - start) / predicted < 4.0  # a shared 2-core box: a factor of 4 either way


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("use_muon, smoothed_snoo", [(True, False), (False, False), (True, True)])
def test_a_snapshot_forecast_from_the_shape_is_what_rollback_holds_after_a_step(use_muon, smoothed_snoo):
    """plan.snapshot_bytes, from parameter counts alone, against rollback.Snapshot's buffers after a real step of
    the real optimizers (their state exists then; with Snoo and the smoothing, theirs too); fused AdamW's step
    counters are the only extra bytes."""
    from optimizers import build_optimizers
    from rollback import Snapshot

    shape = {"n_layer": 4, "n_head": 2, "n_embd": 64}
    torch.manual_seed(0)
    model = get_model({"vocab_size": 512, "seq_len": 32, **shape})
    lrs = dict(muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    extra = dict(update_smoothing=0.2, snoo=(0.68, 0.37, 28)) if smoothed_snoo else {}
    optimizers = build_optimizers(model, use_muon=use_muon, **lrs, **extra)
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    for opt in optimizers:
        opt.step()
    snapshot = Snapshot(model, optimizers, torch.device("cpu"))
    snapshot.take(1, 64)
    counters = sum(s["step"].nbytes for opt in optimizers for s in opt.state.values() if torch.is_tensor(s.get("step")))
    copies = [*snapshot.weights, *(v for state in snapshot.held.values() for v in state.values() if torch.is_tensor(v))]
    held = sum(t.nbytes for t in copies)
    costs = P.shape_costs(shape, 512, 32)
    assert held == P.snapshot_bytes(costs, muon=use_muon, snoo=smoothed_snoo, smoothing=smoothed_snoo) + counters
    if smoothed_snoo:  # and the device holds the same state beside the weights
        kwargs = dict(micro_batch=2, seq_len=32, bf16=False, kind="cpu", world_size=1)
        extra_bytes = P.memory_needed(costs, shape, snoo=True, smoothing=True, **kwargs) - P.memory_needed(
            costs, shape, **kwargs
        )
        assert extra_bytes == 8 * costs["params"] + 4 * costs["muon_params"]


def test_mudds_weights_and_activations_are_in_the_memory_forecast():
    shape = P.shape_config("l16w1024")
    plain, dense = P.shape_costs({**shape, "mudd": False}, 32000, 1024), P.shape_costs(shape, 32000, 1024)
    assert (plain["dense_mixes"], dense["dense_mixes"]) == (0, 2)
    # two mixes of a 1024 -> 64 -> n map: 64 x 1024 + 65 x n each, n = 3 + 3 + 8 heads and 5 sources
    assert dense["params"] - plain["params"] == 2 * 64 * 1024 + 65 * (14 + 5)
    kwargs = dict(micro_batch=19, seq_len=1024, bf16=True, kind="cuda", world_size=32)
    more = P.memory_needed(dense, {**shape, "mudd": True}, **kwargs) - P.memory_needed(plain, shape, **kwargs)
    state = (16 + 4) * (dense["params"] - plain["params"])  # weights, gradient, two moments, DDP's bucket
    activations = 19 * 1024 * 2 * 2 * 1024 * 2  # tokens x 2 mixes x (a normalised input, an output) x width x bf16
    assert more == state + activations


def test_ddps_buckets_are_counted_with_several_ranks_only(event_plan):
    """DDP's fp32 gradient buckets: a fifth copy of the parameters with several ranks (a step's first micro-steps make
    fresh gradients beside them while .grad is None), none on one rank, where there is no DDP."""
    costs = P.shape_costs(P.shape_config("l16w1024"), 32000, 1024)
    kwargs = dict(micro_batch=13, seq_len=1024, bf16=True, kind="cuda")
    shape = P.shape_config("l16w1024")
    ranks = [P.memory_needed(costs, shape, world_size=w, **kwargs) for w in (1, 2, 32)]
    transient = [P.transient_bytes(costs, 13 * 1024, "cuda", w) for w in (1, 2, 32)]
    assert ranks[1] - transient[1] == ranks[0] - transient[0] + 4 * costs["params"]  # 2.1 GB at 529M parameters
    assert ranks[2] == ranks[1]


def test_the_event_plan_counts_transients_and_says_where_the_snapshots_go(event_plan):
    """At the event's plan (micro 19, 32 ranks), the parts on top of state and activations: DDP's fp32
    gradient buckets, the head's chunk buffers, the tables' per-micro-step gradients, the hook's copies of the bigram
    bucket, Muon's gather."""
    plan, _ = event_plan(model="l16w1024")
    costs = P.shape_costs(P.shape_config("l16w1024"), 32000, 1024)
    tokens = plan.micro_batch * 1024
    per_token = 34 * 16 + 2 * costs["n_tables"] + 2 * costs["dense_mixes"]  # MUDD's two mixes: an input, an output
    before = costs["params"] * 16 + tokens * per_token * 1024 * 2  # state and activations alone
    rows = P.chunk_rows(tokens, 32000, 512 << 20)
    head = 4 * rows * 32000 * 4 + (32000 + tokens) * 1024 * 4
    parts = 4 * costs["params"] + head + 4 * costs["table_params"] + 6 * 163_840_000 + 2 * costs["muon_params"]
    assert (plan.micro_batch, rows) == (19, 2432) and plan.memory_gib * 2**30 == before + parts
    assert plan.snapshot_gib * 2**30 == 2 * P.snapshot_bytes(costs, muon=True)
    assert plan.snapshots_on_device and plan.line().endswith("GiB of rollback snapshots on it")
    # a device with room for the rest but not for both snapshots twice over: they go to pinned host memory
    tight, _ = event_plan(model="l16w1024", memory_bytes=plan.memory_gib * 2**30 + plan.snapshot_gib * 2**30)
    assert tight.fits and not tight.snapshots_on_device and tight.micro_batch == plan.micro_batch
    assert "GiB of rollback snapshots in pinned host memory" in tight.line()


# ----------------------------------------------------------------------------- what the plan says


def test_a_micro_batch_that_raises_the_tokens_per_step_says_so(event_plan):
    import dataclasses

    import launch
    import config

    lines = 0
    for overrides in ({"micro_batch": 48}, {"micro_batch": 48, "batch_tokens": 524288}, {"micro_batch": 16}, {}):
        plan, _ = event_plan(**overrides)
        hp, _, _ = config.parse_args(["--dry_run", "--peak_tflops", "2250", "--device_memory_gib", "288"])
        hp = dataclasses.replace(config.resolve(hp, 1), **overrides)
        said = []
        launch.check_plan(plan, hp, 288 * 2**30, 600.0, said.append)
        raised = [line for line in said if line.startswith("--micro_batch")]
        assert plan.tokens_per_step >= plan.asked_tokens_per_step
        assert len(raised) == (plan.tokens_per_step > plan.asked_tokens_per_step and "micro_batch" in overrides), said
        lines += len(raised)
    assert lines >= 2  # 48 x 1,024 x 32 ranks = 1.57M tokens: 2,555,904 asked becomes 3,145,728; 524,288 becomes 1.57M

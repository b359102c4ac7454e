"""The current record's switches in model.py: bigram hash embedding, smear, attention and value-embedding
gates, backout, and the tied-then-split embedding and head, under the organizers' contract; a checkpoint written
without them loads with today's model.py."""

import dataclasses
import itertools
import types
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import config  # noqa: E402
from model import FIRST_KEYS, GPTConfig, bigram_hash, get_model  # noqa: E402
from headloss import compiled_head_loss, head_loss  # noqa: E402
from report import planned_graphs  # noqa: E402
from optimizers import build_optimizers  # noqa: E402

TINY = dict(n_layer=4, n_embd=32, n_head=2, vocab_size=300, seq_len=16)
ON = dict(bigram_mult=3.0, smear=True, attn_gate=True, ve_gate=True, backout=True, untie_at=0.5)
OFF = dict(bigram_mult=0.0, smear=False, attn_gate=False, ve_gate=False, backout=False, untie_at=0.0)
COMBOS = [dict(c) for r in range(len(ON) + 1) for c in itertools.combinations(ON.items(), r)]
LENGTHS = (1, 7, 16, 50)  # shorter than, equal to and beyond the training length


def build(**overrides):
    torch.manual_seed(0)
    return get_model({**TINY, **overrides})


def batch(B=2, T=16, seed=1):
    x = torch.randint(0, TINY["vocab_size"], (B, T + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def train(model, steps, progress=lambda step: 0.0):
    """train.py's step: set_progress, forward and backward through the chunked head, every optimizer's step."""
    opts = build_optimizers(model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    losses = []
    for step in range(steps):
        model.set_progress(progress(step))
        idx, targets = batch(seed=step)
        loss = model(idx, targets, loss_fn=head_loss)[1]
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


ORGANIZER = """
import json, sys, torch
from model import get_model
out = {}
for path in sys.argv[1:]:
    ckpt = torch.load(path, weights_only=True)
    model = get_model(ckpt["config"])
    model.load_state_dict(ckpt["model"])  # strict
    model.eval()
    with torch.no_grad():
        same = [torch.equal(model(idx)[0], ref) for idx, ref in zip(ckpt["idx"], ckpt["logits"])]
        losses = [model(idx, idx)[1].item() for idx in ckpt["idx"]]
    out[path] = all(same) and all(l == l for l in losses)
print(json.dumps(out))
"""


@pytest.mark.parametrize("combos", [[OFF, ON], pytest.param(COMBOS, marks=pytest.mark.slow)], ids=["on_off", "all_64"])
def test_every_switch_combination_loads_with_model_py_alone_and_scores_any_length(tmp_path, combos):
    """A checkpoint of each combination (all 64 in the slow tier), trained a few steps (through the untie where it
    is on), loads in a fresh process that sees model.py alone, with weights_only=True, and gives the same logits
    at every length."""
    alone = tmp_path / "organizer"
    alone.mkdir()
    shutil.copy(ROOT / "model.py", alone / "model.py")
    paths = []
    for i, combo in enumerate(combos):
        model = build(**combo)
        train(model, 2, progress=lambda step: step / 2 + 0.25)  # 0.25 tied, 0.75 split
        model.eval()
        idx = [batch(1, T, seed=T)[0] for T in LENGTHS]
        with torch.no_grad():
            logits = [model(x)[0] for x in idx]
        path = tmp_path / f"ckpt{i}.pt"
        config = dataclasses.asdict(model.config)
        torch.save({"model": model.state_dict(), "config": config, "idx": idx, "logits": logits}, path)
        paths.append(str(path))
    run = subprocess.run(
        [sys.executable, "-c", ORGANIZER, *paths],
        cwd=alone,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = __import__("json").loads(run.stdout.splitlines()[-1])
    failed = [combos[paths.index(p)] for p, ok in result.items() if not ok]
    assert failed == [] and len(result) == len(combos)


# (switch, make the off model's computation exactly: None where the switch already starts neutral)
NEUTRAL_AT_INIT = ["bigram_mult", "smear", "ve_gate", "untie_at"]


@pytest.mark.parametrize("key", list(ON))
def test_each_switch_changes_the_computation_and_its_knobs_at_neutral_reproduce_the_off_model(key):
    off = build(zero_init_proj=False, **OFF)
    on = build(zero_init_proj=False, **{**OFF, key: ON[key]})
    on.load_state_dict(off.state_dict(), strict=False)  # untie_at: the forward never reads the tie
    idx = batch()[0]
    with torch.no_grad():
        ref = off(idx)[0]
        neutral = on(idx)[0]
        if key in NEUTRAL_AT_INIT or key == "backout":  # backout's lambda starts at 0.5: neutral only at 0
            if key == "backout":
                assert not torch.allclose(neutral, ref, atol=1e-4)
                on.backout_lambda.zero_()
                neutral = on(idx)[0]
            torch.testing.assert_close(neutral, ref, atol=1e-5, rtol=1e-5)
        else:  # the attention gate starts at sigmoid(0) = 0.5: each head's output halved
            assert not torch.allclose(neutral, ref, atol=1e-4)
        for name, p in on.named_parameters():  # every new knob moved: the output moves
            if name.endswith(("gate.weight", "bigram.weight", "smear_lambda", "backout_lambda", "bigram_lambda")):
                p.add_(0.5)
        if key != "untie_at":
            assert (on(idx)[0] - ref).abs().max() > 1e-3


def test_every_new_parameter_gets_a_gradient_and_gates_get_their_own_group():
    model = build(**ON)
    idx, targets = batch()
    model(idx, targets)[1].backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    muon, adamw = build_optimizers(model, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
    groups = {g["name"]: g for g in adamw.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    gate_names = sorted(names[id(p)] for p in groups["gate"]["params"])
    assert gate_names == sorted(n for n in names.values() if n.endswith("gate.weight") or n.startswith("mudd."))
    # attention gates; value-embedding gates (all 4 layers get one); smear; MUDD's two mixes' weights and biases
    assert len(gate_names) == 4 + 4 + 1 + 6
    assert groups["gate"]["lr"] == pytest.approx(0.04 * model.config.gate_lr_mult)
    assert {names[id(p)] for p in groups["head"]["params"]} == {"wte.weight", "lm_head.weight"}
    assert "bigram.weight" in {names[id(p)] for p in groups["embed"]["params"]}
    assert not any("gate" in names[id(p)] for g in muon.param_groups for p in g["params"])


def test_tied_phase_steps_one_shared_weight_then_splits():
    """Until untie_at the pair trains exactly as tie_embeddings=True does (one weight, the sum of both gradients,
    the head's LR); from then on the two move apart, and only then."""
    split = build(untie_at=0.5)
    tied = build(tie_embeddings=True)
    tied.load_state_dict({k: v for k, v in split.state_dict().items() if k != "lm_head.weight"})
    with torch.no_grad():
        assert torch.equal(split.lm_head.weight, split.wte.weight)
    opts = build_optimizers(tied, muon_lr=0.02, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04, tied_head=tied.wte.weight)
    ref = []
    for step in range(3):
        idx, targets = batch(seed=step)
        loss = tied(idx, targets, loss_fn=head_loss)[1]
        loss.backward()
        for opt in opts:
            opt.step()
        tied.zero_grad(set_to_none=True)
        ref.append(loss.item())
    progress = [0.0, 0.2, 0.4, 0.6, 0.8]
    losses = train(split, 3, progress=progress.__getitem__)
    assert losses == pytest.approx(ref, rel=1e-5)
    assert split.tied and torch.equal(split.wte.weight, split.lm_head.weight)
    train(split, 1, progress=lambda step: 0.6)
    assert not split.tied and not torch.equal(split.wte.weight, split.lm_head.weight)


def test_bigram_hash_rows():
    idx = torch.tensor([[5, 7, 5, 7], [7, 5, 7, 5]])
    rows = bigram_hash(idx, 1000)
    assert rows[:, 0].tolist() == [999, 999]  # no previous token in the window: the reserved last row
    assert rows[0, 1] == rows[0, 3] != rows[1, 1]  # (5, 7) twice; (7, 5) is another pair
    assert ((rows >= 0) & (rows < 1000)).all()
    big = torch.randint(0, 32000, (4, 1024), generator=torch.Generator().manual_seed(0))
    assert bigram_hash(big.to(torch.int32), 160_000).equal(bigram_hash(big, 160_000))
    assert bigram_hash(big, 160_000).unique().numel() > 0.95 * 4 * 1023  # few collisions among 4K pairs


def test_param_counts_with_every_switch():
    model = build(**ON)
    total = model.num_params()
    assert total == sum(t.numel() for t in model.state_dict().values())  # no buffers: the checkpoint is the params
    tables = ("value_embeds.", "wte.", "bigram.")
    lookup = sum(p.numel() for n, p in model.named_parameters() if n.startswith(tables))
    assert model.num_params(non_embedding=True) == total - lookup
    assert model.bigram.num_embeddings == int(3.0 * TINY["vocab_size"])


@pytest.mark.slow
def test_compiled_training_with_every_switch_matches_eager_and_compiles_the_planned_graphs():
    model = build(**ON, zero_init_proj=False)
    idx, targets = batch()
    eager = model(idx, targets, loss_fn=head_loss)[1]
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # other tests in this process compiled too
    model.compile_per_block()
    loss_fn = compiled_head_loss()
    loss = model(idx, targets, loss_fn=loss_fn)[1]
    loss.backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    with torch.compiler.set_stance("fail_on_recompile"):  # the second step compiles nothing
        model(idx, targets, loss_fn=loss_fn)[1].backward()
    assert abs(loss.item() - eager.item()) < 1e-5
    assert graphs == planned_graphs(model, idx.numel(), "cpu")


# ----------------------------------------------------------------------------- checkpoints older than the switches


LATER = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in FIRST_KEYS]


def test_a_checkpoint_written_before_the_record_switches_loads_with_todays_model_py(tmp_path):
    torch.manual_seed(0)
    off = {"bigram_mult": 0.0, "ve_gate": False, "backout": False, "smear": False, "attn_gate": False, "mudd": False}
    old = get_model({**TINY, **off, "zero_init_proj": False})
    old_config = {k: v for k, v in dataclasses.asdict(old.config).items() if k not in LATER}
    assert set(old_config) == set(FIRST_KEYS) and {"bigram_mult", "ve_gate", "backout"} <= set(LATER)
    torch.save({"model": old.state_dict(), "config": old_config, "step": 7}, tmp_path / "old.pt")
    ckpt = torch.load(tmp_path / "old.pt", weights_only=True)
    model = get_model(ckpt["config"])  # the organizers' two lines
    model.load_state_dict(ckpt["model"])  # strict: no bigram table, value-embedding gate or backout weight missing
    idx = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], old(idx)[0])


def test_a_partial_or_whole_config_of_today_keeps_todays_defaults():
    defaults = GPTConfig()
    assert get_model(TINY).bigram is not None and get_model(TINY).backout_lambda is not None
    whole = get_model({**dataclasses.asdict(defaults), **TINY})  # a checkpoint written today
    assert whole.config == dataclasses.replace(defaults, **TINY)


def test_every_old_switch_given_as_a_flag_still_builds_todays_model():
    # the flags of every switch a first checkpoint held, at their defaults: the run's dict then holds every FIRST_KEYS
    # key, yet it is no checkpoint's; the plan and the model keep the later switches on
    import kernels
    import launch
    import plan

    flags = [f"--{k}={getattr(GPTConfig(), k)}" for k in FIRST_KEYS if k not in config.parse_args([])[0].__dict__]
    hp, switches, unknown = config.parse_args(["--device", "cpu", *flags])
    assert not unknown and set(FIRST_KEYS) <= {*switches, "vocab_size", "seq_len", "n_layer", "n_head", "n_embd"}
    hp = config.resolve(hp, 1)
    shape = types.SimpleNamespace(n_layer=2, n_head=2, n_embd=32)
    model, *_ = launch.build_model(hp, shape, switches, torch.device("cpu"), 1, kernels.EagerRuns(print, False))
    assert model.bigram is not None and model.backout_lambda is not None
    costs = plan.shape_costs({"n_layer": 2, "n_head": 2, "n_embd": 32, **switches}, hp.vocab_size, hp.seq_len)
    assert costs["params"] == model.num_params()

"""Rollback: the divergence rule, the snapshot's round trip, the LR cuts; real runs in the slow tier (a run that
diverges for good stops with its last trusted weights, never a non-finite checkpoint)."""

import json
import math
import subprocess
import sys

import pytest
import torch

import rollback as R
from conftest import FLOOR, TINY, TRAIN, child_env, command, on_tokens, read_metrics, run_train
from eval import load_checkpoint
from model import get_model
from optimizers import build_optimizers


def small_model_and_optimizers():
    torch.manual_seed(0)
    model = get_model({"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32})
    return model, build_optimizers(model, use_muon=True, muon_lr=0.02, embed_lr=0.1, head_lr=0.01, scalar_lr=0.01)


def train_steps(model, optimizers, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, 64, (4, 16), generator=gen)
        _, loss = model(idx, idx)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)


def test_a_spike_must_last_two_syncs_and_a_non_finite_loss_is_at_once():
    guard = R.Guard(*small_model_and_optimizers(), torch.device("cpu"), print)
    # a plateau at 4.0, noise, one high sync (5.2 > 4.0 + 1), back down: nothing
    assert [guard.diverged(x) for x in (4.0, 4.0, 4.0, 4.9, 5.2, 4.1)] == [None] * 6
    assert guard.diverged(5.3) is None and "nats above" in guard.diverged(5.4)  # two syncs in a row above 5.0
    assert guard.diverged(float("nan")) == "non-finite loss" and guard.diverged(math.inf) == "non-finite loss"


def test_a_snapshot_is_trusted_after_a_healthy_sync_and_a_rollback_trains_on_exactly_as_from_it():
    model, optimizers = small_model_and_optimizers()
    guard = R.Guard(model, optimizers, torch.device("cpu"), print)  # the initial weights: trusted
    train_steps(model, optimizers, 3, seed=0)
    assert guard.diverged(4.0) is None and not guard.maybe_snapshot(step=3, tokens=96, elapsed=10.0)  # 30 s apart
    assert guard.maybe_snapshot(step=3, tokens=96, elapsed=31.0) and guard.trusted.step == 0 and guard.pending.step == 3
    expected = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    train_steps(model, optimizers, 2, seed=1)
    assert guard.diverged(4.1) is None and guard.trusted.step == 3  # a healthy sync trusts it
    train_steps(model, optimizers, 4, seed=2)  # the bad stretch, then NaN weights
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert guard.roll_back(step=9, why="test", batch_factor=1.0)
    assert all(torch.equal(a, p) for a, p in zip(expected, model.parameters()))
    restored = [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(state, restored)) and len(state) == len(restored) > 0
    # until the next step the weights are step 3's, and the checkpoint and the log say so
    assert guard.weights_of(9, 288) == (3, 96) and guard.weights_of(10, 320) == (10, 320)


def test_a_rollback_to_the_initial_weights_starts_the_optimizers_afresh():
    model, optimizers = small_model_and_optimizers()
    initial = [p.detach().clone() for p in model.parameters()]
    guard = R.Guard(model, optimizers, torch.device("cpu"), print)
    train_steps(model, optimizers, 2, seed=0)
    assert guard.roll_back(step=2, why="test", batch_factor=1.0) and guard.rollbacks[0]["to_step"] == 0
    assert all(torch.equal(a, p) for a, p in zip(initial, model.parameters()))
    assert all(not opt.state for opt in optimizers)


def untie_model_and_optimizers():
    torch.manual_seed(0)
    config = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "untie_at": 0.5}
    model = get_model(config)
    return model, build_optimizers(model, use_muon=True, muon_lr=0.02, embed_lr=0.1, head_lr=0.01, scalar_lr=0.01)


def untie_steps(model, optimizers, n, progress, seed):
    model.set_progress(progress)  # before untie_at the embedding gets no gradient of its own, so no AdamW state
    train_steps(model, optimizers, n, seed)


def test_optimizer_state_that_appears_after_the_snapshot_is_reset_and_the_rest_restored_in_place():
    model, optimizers = untie_model_and_optimizers()
    adamw, wte = optimizers[1], model.wte.weight
    guard = R.Guard(model, optimizers, torch.device("cpu"), print)
    untie_steps(model, optimizers, 3, progress=0.1, seed=0)
    assert guard.maybe_snapshot(step=3, tokens=192, elapsed=31.0) and guard.diverged(4.0) is None
    assert guard.trusted.step == 3 and wte not in adamw.state
    expected = {p: {k: v.clone() for k, v in s.items()} for opt in optimizers for p, s in opt.state.items()}
    live = {p: dict(s) for opt in optimizers for p, s in opt.state.items()}
    untie_steps(model, optimizers, 2, progress=0.6, seed=1)  # untied: the embedding's AdamW state appears
    with torch.no_grad():  # and blows up, as state that appeared in the bad stretch can
        for value in adamw.state[wte].values():
            value.fill_(float("nan"))
    assert guard.roll_back(step=5, why="test", batch_factor=1.0)
    assert wte not in adamw.state  # reset: it starts afresh, as it first did
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    assert state.keys() == expected.keys()
    for p, saved in expected.items():
        assert state[p].keys() == saved.keys() and all(torch.equal(state[p][k], v) for k, v in saved.items())
        assert all(state[p][k] is live[p][k] for k in saved)  # copied in place: the same tensors
    untie_steps(model, optimizers, 2, progress=0.7, seed=2)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_key_that_appears_after_the_snapshot_is_removed_and_a_python_number_travels_by_value():
    model, optimizers = small_model_and_optimizers()
    guard = R.Guard(model, optimizers, torch.device("cpu"), print)
    train_steps(model, optimizers, 2, seed=0)
    muon_state = next(iter(optimizers[0].state.values()))
    muon_state["count"] = 2  # an optimizer that keeps a python number
    assert guard.maybe_snapshot(step=2, tokens=128, elapsed=31.0) and guard.diverged(4.0) is None
    muon_state["count"] = 7
    muon_state["second_moment"] = torch.full((3,), float("nan"))  # a key the snapshot never saw (NorMuon's kind)
    assert guard.roll_back(step=4, why="test", batch_factor=1.0)
    assert muon_state["count"] == 2 and "second_moment" not in muon_state


def test_a_rollback_restores_snoos_slow_weights_and_momentum_and_the_smoothed_updates():
    torch.manual_seed(0)
    model = get_model({"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 32})
    lrs = dict(muon_lr=0.02, embed_lr=0.1, head_lr=0.01, scalar_lr=0.01)
    optimizers = build_optimizers(model, update_smoothing=0.2, snoo=(0.68, 0.37, 2), **lrs)
    snoo = optimizers[-1]
    guard = R.Guard(model, optimizers, torch.device("cpu"), print)
    train_steps(model, optimizers, 3, seed=0)  # Snoo's outer steps after steps 1 and 3
    assert guard.maybe_snapshot(step=3, tokens=192, elapsed=31.0) and guard.diverged(4.0) is None
    expected = [
        {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in o.state.items()}
        for o in optimizers
    ]
    weights = [p.detach().clone() for p in model.parameters()]
    train_steps(model, optimizers, 2, seed=1)  # and after step 5: every kind of their state moves
    moved = [s for p, s in snoo.state.items() if not torch.equal(s["slow"], expected[-1][p]["slow"])]
    assert moved and all(s["outer_steps"] == 5 for s in snoo.state.values())
    assert guard.roll_back(step=5, why="test", batch_factor=1.0)
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    for opt, saved in zip(optimizers, expected):
        for p, state in saved.items():
            live = opt.state[p]
            assert live.keys() == state.keys()
            assert all(torch.equal(live[k], v) if torch.is_tensor(v) else live[k] == v for k, v in state.items())
    kinds = {k for s in optimizers[0].state.values() for k in s} | {k for s in snoo.state.values() for k in s}
    assert {"smoothed_update", "slow", "outer_momentum", "outer_steps"} <= kinds


def test_each_rollback_drops_the_batch_factor_first_then_halves_the_lr_and_they_run_out():
    guard = R.Guard(*small_model_and_optimizers(), torch.device("cpu"), print)
    scales = []
    for step in range(R.MAX_ROLLBACKS):
        assert guard.roll_back(step=2 + step, why="test", batch_factor=2.0)
        scales.append(guard.lr_scale(2.0))
    assert scales == [1.0, 0.5, 0.25][: R.MAX_ROLLBACKS] and guard.lr_scale(0.8) == 0.8 * 0.5 ** (R.MAX_ROLLBACKS - 1)
    assert not guard.roll_back(step=9, why="used up", batch_factor=2.0) and len(guard.rollbacks) == R.MAX_ROLLBACKS


STEPS = ["--max_steps", "150", "--time_limit_min", "10", "--log_every_s", "0", "--save_every_min", "0"]


@pytest.mark.slow
def test_lrs_that_diverge_roll_back_and_end_near_a_stable_run(tmp_path, token_dir):
    # --head_lr 1 (125x the default): without rollback the loss ends above where it started (BENCHMARKS)
    results = {}
    for name, lrs in (("stable", []), ("diverging", ["--head_lr", "1"])):
        out = tmp_path / name
        out.mkdir()
        args = [*on_tokens(token_dir), *TINY, *STEPS, *lrs, "--checkpoint_path", str(out / "ckpt.pt")]
        proc = subprocess.run(command(args, 1), cwd=out, env=child_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = read_metrics(out / "metrics.jsonl")[2]
    stable, diverging = results["stable"], results["diverging"]
    assert stable["rollbacks"] == [] and len(diverging["rollbacks"]) >= 1, diverging["rollbacks"]
    assert diverging["stop_reason"] == "max_steps" and diverging["final_lr_frac"] == FLOOR
    assert diverging["val_loss"] < stable["val_loss"] + 0.5, (diverging["val_loss"], stable["val_loss"])
    _, ckpt = load_checkpoint(tmp_path / "diverging" / "ckpt.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


@pytest.mark.slow
def test_one_ranks_spike_rolls_back_both_ranks_at_the_same_step_and_their_weights_stay_equal(tmp_path, token_dir):
    script = f"""
import json, sys
sys.path.insert(0, {str(TRAIN.parent)!r})
import torch, train

accumulate, finish, calls = train.Trainer.accumulate, train.Trainer.finish, [0]
def spiking(trainer, *args, **kwargs):
    loss = accumulate(trainer, *args, **kwargs)
    calls[0] += 1
    spike = torch.tensor([50.0, 0.0])  # accumulate's (loss, count): the loss alone
    return loss + spike if trainer.run.rank == 1 and 20 <= calls[0] < 24 else loss  # rank 1 alone, four steps
def recording(trainer):
    weights = sum(p.double().sum().item() for p in trainer.run.raw_model.parameters())
    with open(f"rank{{trainer.run.rank}}.json", "w") as f:
        json.dump({{"rollbacks": trainer.guard.rollbacks, "weights": weights}}, f)
    return finish(trainer)
train.Trainer.accumulate, train.Trainer.finish = spiking, recording
train.main(sys.argv[1:])
"""
    args = [*on_tokens(token_dir), *TINY, *STEPS]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python"]
    proc = subprocess.run(
        [*torchrun, sys.executable, "-c", script, *args],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]["rollbacks"]) == 1 and ranks[0]["rollbacks"] == ranks[1]["rollbacks"], ranks
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
def test_a_diverging_run_never_saves_non_finite_weights(tmp_path, token_dir):
    # without the soft-cap the logits are unbounded: these LRs overflow them within a few steps
    huge = ["--muon_lr", "1e6", "--embed_lr", "1e6", "--head_lr", "1e6", "--scalar_lr", "1e6", "--logit_softcap", "0"]
    args = [
        *on_tokens(token_dir),
        *TINY,
        *huge,
        "--time_limit_min",
        "0.2",
        "--log_every_s",
        "0",
        "--save_every_min",
        "1e-9",
    ]
    proc, _ = run_train(args, tmp_path)  # each rollback halves LRs a million times too high: they run out
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "diverged" and len(summary["rollbacks"]) == 3, summary
    model, ckpt = load_checkpoint(tmp_path / "checkpoint.pt")
    # the checkpoint and the final validation row say the step of the snapshot they hold, not the last step run
    assert f"holds the weights of step {ckpt['step']}, the last trusted snapshot" in proc.stdout
    assert ckpt["step"] == val[-1]["step"] == summary["weights_step"] < summary["steps"], (ckpt["step"], summary)
    assert ckpt["tokens"] == val[-1]["tokens"] < summary["tokens"]
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert not list(tmp_path.glob("*.tmp"))

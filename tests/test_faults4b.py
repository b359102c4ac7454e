"""Fault hardening, fourth round (issue 44): ranges and compatibility (model switches' ranges, boolean flags in the
nanoGPT idiom, checkpoints older than the record's switches) and ranks that die outside the training loop."""

import dataclasses
import types

import pytest
import torch

import config
from conftest import TINY
from model import FIRST_KEYS, GPTConfig, get_model
from tailema import TailEMA
from windows import DataChanged

# ----------------------------------------------------------------------------- boolean flags


@pytest.mark.parametrize(
    "argv, name, value",
    [
        (["--compile", "False"], "compile", False),
        (["--compile=false"], "compile", False),
        (["--compile", "0"], "compile", False),
        (["--compile", "yes"], "compile", True),
        (["--compile"], "compile", True),
        (["--no-compile"], "compile", False),
        ([], "compile", "auto"),
        (["--doc_aligned", "True", "--seq_len", "64"], "doc_aligned", True),
        (["--doc_aligned", "--seq_len", "64"], "doc_aligned", True),  # a bare flag takes no value that is a flag
        (["--dry_run", "no"], "dry_run", False),
    ],
)
def test_a_boolean_flag_reads_its_value_in_the_nanogpt_idiom(argv, name, value):
    hp, _, unknown = config.parse_args(argv)
    assert getattr(hp, name) == value and unknown == [], (argv, getattr(hp, name), unknown)


def test_a_model_switch_reads_its_value_too():
    assert config.parse_args(["--qk_norm", "False", "--backout=0", "--smear", "true"])[1] == {
        "qk_norm": False,
        "backout": False,
        "smear": True,
    }
    assert config.parse_args(["--no-ve_gate", "--attn_gate"])[1] == {"ve_gate": False, "attn_gate": True}


UNREADABLE = [["--compile", "Flase"], ["--doc_aligned=maybe"], ["--qk_norm", "2"], ["--seq_len", "x"]]


@pytest.mark.parametrize("argv", UNREADABLE)
def test_a_value_a_flag_cannot_take_is_one_sentence_and_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as leaving:
        config.parse_args(argv)
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 2 and error.startswith("error: argument " + argv[0].split("=")[0]), error
    assert "\n" not in error and "usage" not in error, error


# ----------------------------------------------------------------------------- model switches' ranges

SWITCH_CASES = {
    "gate LR negative": ("--gate_lr_mult", "-0.1"),
    "gate LR nan": ("--gate_lr_mult", "nan"),
    "gate LR inf": ("--gate_lr_mult", "inf"),
    "rope base inf": ("--rope_base", "inf"),
    "rope base 1": ("--rope_base", "1"),
    "untie at the end": ("--untie_at", "1"),
    "untie negative": ("--untie_at", "-0.5"),
    "bigram nan": ("--bigram_mult", "nan"),
    "softcap negative": ("--logit_softcap", "-1"),
    "mlp ratio 0": ("--mlp_ratio", "0"),
}


@pytest.mark.parametrize("flag, value", SWITCH_CASES.values(), ids=SWITCH_CASES.keys())
def test_a_model_switch_out_of_its_range_is_one_sentence_naming_it(flag, value):
    hp, switches, _ = config.parse_args([flag, value])
    with pytest.raises(ValueError) as error:
        config.check_flags(hp, switches)
    assert str(error.value).startswith(f"{flag} must be") and "\n" not in str(error.value), error.value
    config.check_flags(hp, {})  # the dataclass flags alone are fine


def test_the_default_switches_and_an_ablation_are_in_range():
    hp, switches, _ = config.parse_args(["--gate_lr_mult", "0", "--bigram_mult", "0", "--untie_at", "0.5"])
    config.check_flags(hp, switches)
    config.check_flags(hp, {f.name: f.default for f in dataclasses.fields(GPTConfig)})


def test_a_gate_lr_that_would_train_silently_wrong_exits_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import train

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as leaving:
        train.main([*TINY, "--gate_lr_mult", "nan", "--checkpoint_path", str(tmp_path / "ckpt.pt")])
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 2 and error == "error: --gate_lr_mult must be a finite number, got nan", error
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- checkpoints older than the switches

SHAPE = {"vocab_size": 200, "seq_len": 16, "n_layer": 4, "n_head": 2, "n_embd": 32}
LATER = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in FIRST_KEYS]


def test_a_checkpoint_written_before_the_record_switches_loads_with_todays_model_py(tmp_path):
    torch.manual_seed(0)
    off = {"bigram_mult": 0.0, "ve_gate": False, "backout": False, "smear": False, "attn_gate": False, "mudd": False}
    old = get_model({**SHAPE, **off, "zero_init_proj": False})
    old_config = {k: v for k, v in dataclasses.asdict(old.config).items() if k not in LATER}
    assert set(old_config) == set(FIRST_KEYS) and {"bigram_mult", "ve_gate", "backout"} <= set(LATER)
    torch.save({"model": old.state_dict(), "config": old_config, "step": 7}, tmp_path / "old.pt")
    ckpt = torch.load(tmp_path / "old.pt", weights_only=True)
    model = get_model(ckpt["config"])  # the organizers' two lines
    model.load_state_dict(ckpt["model"])  # strict: no bigram table, value-embedding gate or backout weight missing
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], old(idx)[0])


def test_a_partial_or_whole_config_of_today_keeps_todays_defaults():
    defaults = GPTConfig()
    assert get_model(SHAPE).bigram is not None and get_model(SHAPE).backout_lambda is not None
    whole = get_model({**dataclasses.asdict(defaults), **SHAPE})  # a checkpoint written today
    assert whole.config == dataclasses.replace(defaults, **SHAPE)


def test_every_old_switch_given_as_a_flag_still_builds_todays_model():
    # the flags of every switch a first checkpoint held, at their defaults: the run's dict then holds every FIRST_KEYS
    # key, yet it is no checkpoint's; the plan and the model keep the later switches on
    import launch
    import plan

    flags = [f"--{k}={getattr(GPTConfig(), k)}" for k in FIRST_KEYS if k not in config.parse_args([])[0].__dict__]
    hp, switches, unknown = config.parse_args(["--device", "cpu", *flags])
    assert not unknown and set(FIRST_KEYS) <= {*switches, "vocab_size", "seq_len", "n_layer", "n_head", "n_embd"}
    hp = launch.resolve(hp, 1)
    shape = types.SimpleNamespace(n_layer=2, n_head=2, n_embd=32)
    model, *_ = launch.build_model(hp, shape, switches, torch.device("cpu"), 1, launch.EagerRuns(print, False))
    assert model.bigram is not None and model.backout_lambda is not None
    costs = plan.shape_costs({"n_layer": 2, "n_head": 2, "n_embd": 32, **switches}, hp.vocab_size, hp.seq_len)
    assert costs["params"] == model.num_params()


# ----------------------------------------------------------------------------- a rank that dies outside the loop

# Rank 1 runs through this wrapper and is killed (SIGKILL: no handler, no goodbye) at PHASE; rank 0 runs train.py.
DYING_WORKER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import launch, train

def dying(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

phase = os.environ["PHASE"]
if phase == "finish":  # after every rank saved and validated, right before the final barrier
    finish = train.finish
    train.finish = lambda *args: finish(*args) and dying()
else:  # in place of that collective: rank 0 waits in it for a peer that is gone
    setattr(launch, phase, dying)
train.main()
"""


def two_ranks_rank_1_dying(tmp_path, phase, args):
    """Rank 0 (train.py) and rank 1 (DYING_WORKER), started by hand so that each exit code is seen: rank 0's
    (returncode, stdout, stderr)."""
    import socket
    import subprocess
    import sys

    from conftest import ROOT, TRAIN, child_env

    worker = tmp_path / "worker.py"
    worker.write_text(DYING_WORKER.format(root=str(ROOT)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**child_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PHASE": phase}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            cwd=tmp_path,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, script in ((0, TRAIN), (1, worker))
    ]
    out, err = ranks[0].communicate(timeout=240)
    ranks[1].communicate(timeout=60)
    assert ranks[1].returncode == -9, ranks[1].returncode
    return ranks[0].returncode, out, err


def test_a_lost_peer_before_the_clock_is_one_sentence_and_exit_1(monkeypatch, capsys):
    import ranks
    import train

    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50877. This is typically caused by ...")
    monkeypatch.setattr(ranks.dist, "is_initialized", lambda: True)  # train.dist and ranks.dist: one module
    monkeypatch.setattr(ranks.dist, "get_rank", lambda: 3)
    with pytest.raises(RuntimeError):  # a check's collective: not swallowed into an input error's sentence
        ranks.sentence(gone)
    assert ranks.sentence(ValueError("--seq_len must be at least 1, got 0")) == "--seq_len must be at least 1, got 0"

    def launch(*args):
        raise gone

    monkeypatch.setattr(train, "launch", launch)
    with pytest.raises(SystemExit) as leaving:
        train.main(["--device", "cpu"])
    error = capsys.readouterr().err.strip()
    assert leaving.value.code == 1 and error.count("\n") == 0, error
    assert error.startswith("error: rank 3 lost contact with the other ranks before training ([pair.cc:553] Conn")
    monkeypatch.setattr(train, "launch", lambda *args: ranks.fail("error: an input error", code=2))
    with pytest.raises(SystemExit) as leaving:
        train.main(["--device", "cpu"])
    assert leaving.value.code == 2


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["training_deadline", "agreed_matmul_rate"])  # outside, inside a check's try
def test_a_rank_that_dies_before_the_clock_leaves_one_sentence(tmp_path, token_dir, phase):
    from conftest import on_tokens

    rc, out, err = two_ranks_rank_1_dying(tmp_path, phase, [*on_tokens(token_dir), *TINY, "--device", "cpu"])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("error: rank 0 lost contact with the other ranks before training ("), errors


@pytest.mark.slow
def test_a_rank_that_dies_after_the_run_finished_leaves_it_finished(tmp_path, token_dir):
    from conftest import on_tokens, read_metrics

    args = [*on_tokens(token_dir), *TINY, "--device", "cpu", "--time_limit_min", "0.1"]
    rc, out, err = two_ranks_rank_1_dying(tmp_path, "finish", args)
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "warning: rank 0: a peer left before the final barrier (" in err
    _, val, summary = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["stop_reason"] == "time_limit" and summary["world_size"] == 2 and val[-1]["val_loss"] > 0
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == summary["steps"] > 0


# ----------------------------------------------------------------------------- the quick start's spike: the rows


class RowLog:
    """The metrics rows host_sync writes, kept (report.Logger's calls)."""

    def __init__(self):
        self.rows = []

    def row(self, step, tokens, elapsed, lr_frac, train_loss):
        self.rows.append((step, train_loss))

    def notes(self):
        pass

    def failed_save(self, wait=True):
        pass


def test_each_metrics_row_is_the_mean_of_its_steps_through_replans_rollbacks_and_uneven_syncs():
    """train.host_sync and the loop's calls, on a fake clock whose device is 20x the forecast and a step cap that
    binds (so the accumulation is replanned at syncs), with syncs of 1 to many steps and three non-finite steps
    (rollbacks): every row is the mean of the losses of exactly the steps since the row before."""
    import rollback
    import train
    from clock import Clock

    torch.manual_seed(0)
    model = get_model({**SHAPE, "n_layer": 1})
    guard = rollback.Guard(model, [], torch.device("cpu"), lambda message: None)
    ema = TailEMA(model, 0.0, 0.12)  # off, as by default
    hp = types.SimpleNamespace(seq_len=16, save_every_min=0.0, lr_rule="none")
    run = types.SimpleNamespace(
        rank=0, world=1, device=torch.device("cpu"), data_gone=None, stop_signal=[], hp=hp, val=[], say=print
    )
    run.plan, run.raw_model = types.SimpleNamespace(micro_batch=2), model
    clock = Clock(60.0, 400, 1, 0.35, may_replan=True, planned_step_s=1.0)
    log, state, loss_sum, elapsed, losses, syncs = RowLog(), train.LoopState(), torch.zeros(2), 0.0, [], []
    while True:
        if clock.due(state.step):
            syncs.append(state.step)
            if train.host_sync(run, clock, log, state, guard, ema, loss_sum, elapsed, None):
                break
        _, accum = clock.begin_step(state.step)
        loss = float("nan") if state.step in (40, 90, 150) else 3.0 + (state.step * 7919 % 13) / 10
        losses.append(loss)
        loss_sum += torch.tensor([loss, 1.0])  # accumulate's (loss, count)
        elapsed += 0.05 * accum * (1 + (state.step % 5 == 0))  # uneven steps: syncs of one step and of many
        state.step += 1
    assert sum("replan" in note for note in clock.notes) >= 2  # the cap made the clock replan (up, then down)
    assert len(guard.rollbacks) == 3 and len(log.rows) > 20
    assert len({b - a for a, b in zip(syncs, syncs[1:])}) >= 3  # syncs of one step and of several
    for step, loss in log.rows:
        start = syncs[syncs.index(step) - 1]
        assert abs(loss - sum(losses[start:step]) / (step - start)) < 1e-5, (start, step)
    written = {step for step, _ in log.rows}
    assert [s for s in syncs[1:] if s not in written] == [next(s for s in syncs if s > n) for n in (40, 90, 150)]


class GoneAfterOne:
    """A loader whose rank's data goes away after its first batch."""

    def __init__(self, batch):
        self.batches = [batch]

    def __next__(self):
        if not self.batches:
            raise DataChanged("every file of this rank changed")
        return self.batches.pop()


def test_a_stand_in_batch_counts_in_neither_the_step_loss_nor_the_row(monkeypatch):
    """A rank whose data is gone mid-step trains on a zero-weight stand-in (inputs = targets = 0) until the next host
    sync: its loss (~ln V at these weights) must not reach the row, which is the mean over the batches that count."""
    import contextlib
    import train
    from headloss import head_loss

    torch.manual_seed(0)
    model = get_model({**SHAPE, "n_layer": 1})
    x = torch.randint(3, SHAPE["vocab_size"], (2, 16))
    real = model(x, x.roll(-1, 1), loss_fn=head_loss)[1].item()
    monkeypatch.setattr(model, "no_sync", contextlib.nullcontext, raising=False)  # DDP's, as world 2 calls it
    run = types.SimpleNamespace(
        model=model, world=2, rank=1, data_gone=None, loader=GoneAfterOne((x, x.roll(-1, 1))), device=x.device
    )
    run.plan, run.hp = types.SimpleNamespace(micro_batch=2), types.SimpleNamespace(seq_len=16)
    loss, counted = train.accumulate(run, 2, contextlib.nullcontext(), head_loss).tolist()
    assert run.data_gone and counted == 0.5  # the second micro-batch was the stand-in
    assert abs(loss / counted - real) < 1e-5, (loss / counted, real)


def loader_against_serial_reading(seq_len, batches, pause_s):
    """Batches from the threaded BatchLoader on the built-in synthetic data, the reader pausing at random, against
    the same windows read serially: how many differ."""
    import itertools
    import random
    import time

    import numpy as np

    from data import BatchLoader, load_token_data
    from shards import Deal, Shards
    from windows import WindowReader, WindowSpec

    data = load_token_data(None, 1024, seq_len, 1 << 16, None)
    spec, deal, rng = WindowSpec(seq_len, vocab_size=1024), Deal(0, 1, seed=0), random.Random(0)
    reader = WindowReader(data.train, spec)
    serial = itertools.chain.from_iterable(
        w for _, w in reader.stream(Shards([len(data.train[0])], seq_len, deal).ranges)
    )
    differ = 0
    with BatchLoader(data.train, spec, 8, deal) as loader:
        for _ in range(batches):
            x, y = next(loader)
            want = torch.from_numpy(np.stack([next(serial) for _ in range(8)]).astype(np.int64))
            differ += not (torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:]))
            if rng.random() < 0.1:
                time.sleep(rng.random() * pause_s)
    return differ


def test_the_loader_serves_every_batch_as_read_while_its_thread_races_ahead():
    # the quick start's spike (BENCHMARKS.md): a batch whose targets are not its inputs' next tokens would read ~10.7
    assert loader_against_serial_reading(seq_len=64, batches=2000, pause_s=0.002) == 0

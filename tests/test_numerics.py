"""The numbers a run reports are the ones it trained on: each metrics row is the mean of exactly its steps' losses
(through replans, rollbacks and syncs of one step or many), a stand-in batch counts in neither a step's loss nor its
row, and the threaded loader serves exactly the windows a serial read gives. In process, on tiny models."""

import types

import torch

from model import get_model
from tailema import TailEMA
from windows import DataChanged


SHAPE = {"vocab_size": 200, "seq_len": 16, "n_layer": 4, "n_head": 2, "n_embd": 32}


def fake_run(model, hp=(), **fields):
    """What a Trainer reads of a train.Run, around model: one CPU rank, micro-batches of 2 windows of 16 tokens,
    no attention backend; hp's entries added to its hyperparameters, fields set on it (replacing any of those)."""
    hp = types.SimpleNamespace(seq_len=16, autocast="none", profile=False, budget_spans_jobs=False, **dict(hp))
    plan = types.SimpleNamespace(micro_batch=2)
    run = types.SimpleNamespace(model=model, raw_model=model, rank=0, world=1, device=torch.device("cpu"), hp=hp)
    run.plan, run.attention, run.resumed, run.state_writer = plan, None, None, None
    vars(run).update(fields)
    return run


# ----------------------------------------------------------------------------- a metrics row is the mean of its steps


class RowLog:
    """The metrics rows Trainer.host_sync writes, kept (report.Logger's calls)."""

    def __init__(self):
        self.rows = []

    def row(self, step, tokens, elapsed, lr_frac, train_loss):
        self.rows.append((step, train_loss))

    def notes(self):
        pass

    def failed_save(self, wait=True):
        pass


def test_each_metrics_row_is_the_mean_of_its_steps_through_replans_rollbacks_and_uneven_syncs():
    """Trainer.host_sync and the loop's calls, on a fake clock whose device is 20x the forecast and a step cap that
    binds (so the accumulation is replanned at syncs), with syncs of 1 to many steps and three non-finite steps
    (rollbacks): every row is the mean of the losses of exactly the steps since the row before."""
    import rollback
    import train
    from clock import Clock

    torch.manual_seed(0)
    model = get_model({**SHAPE, "n_layer": 1})
    guard = rollback.Guard(model, [], torch.device("cpu"), lambda message: None)
    ema = TailEMA(model, 0.0, 0.12)  # off, as by default
    hp = {"save_every_min": 0.0, "lr_rule": "none"}
    stop_signals = types.SimpleNamespace(received=False)
    run = fake_run(model, hp, stop_signals=stop_signals, val=[], say=print)
    clock = Clock(60.0, 400, 1, 0.35, may_replan=True, planned_step_s=1.0)
    log, elapsed, losses, syncs = RowLog(), 0.0, [], []
    trainer = train.Trainer(run, clock=clock, log=log, guard=guard, ema=ema)
    while True:
        if clock.due(trainer.step):
            syncs.append(trainer.step)
            if trainer.host_sync(elapsed):
                break
        _, accum = clock.begin_step(trainer.step)
        loss = float("nan") if trainer.step in (40, 90, 150) else 3.0 + (trainer.step * 7919 % 13) / 10
        losses.append(loss)
        trainer.loss_sum += torch.tensor([loss, 1.0])  # accumulate's (loss, count)
        elapsed += 0.05 * accum * (1 + (trainer.step % 5 == 0))  # uneven steps: syncs of one step and of many
        trainer.step += 1
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
    run = fake_run(model, world=2, rank=1, loader=GoneAfterOne((x, x.roll(-1, 1))), device=x.device, loss_fn=head_loss)
    trainer = train.Trainer(run, clock=object(), log=object(), guard=object(), ema=object())
    loss, counted = trainer.accumulate(2).tolist()
    assert trainer.data_gone and counted == 0.5  # the second micro-batch was the stand-in
    assert abs(loss / counted - real) < 1e-5, (loss / counted, real)


# ----------------------------------------------------------------------------- the loader serves what it read


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

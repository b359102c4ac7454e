"""A loss that blows up rolls back: a snapshot of the weights and optimizer state every SNAPSHOT_EVERY_S on the clock,
a divergence test at each host sync, and a restore with lower LRs instead of an ended run.

Every decision here is taken from numbers all ranks agree on (the all-reduced mean loss, the slowest rank's clock),
so every rank snapshots, rolls back and lowers its LRs at the same step, and the weights stay identical.
"""

import math

import torch

SNAPSHOT_EVERY_S = 30.0  # on the clock: the most training a rollback throws away
# a divergence: a non-finite loss, or a sync's mean loss SPIKE_NATS above the best smoothed loss for SPIKE_SYNCS syncs
# in a row. One nat is far outside the noise of a mean over a sync's steps (a few tenths at the CPU's tiny batches,
# less at the event's) and far inside a real blow-up (loss back toward ln(vocab) = 10.4 within a few steps); two syncs
# keep a single bad batch from costing a rollback
SPIKE_NATS = 1.0
SPIKE_SYNCS = 2
SMOOTHING = 0.3  # weight of the newest sync in the smoothed loss
MAX_ROLLBACKS = 3  # then the run stops ("diverged") and saves the last good snapshot


class Snapshot:
    """Weights and optimizer state, copied into buffers allocated once (again when the optimizers first create their
    state): on the device when it has room (5.54 GB at l16w1024 against ~275 GB: plan.snapshot_bytes), else in
    pinned host memory."""

    def __init__(self, model, optimizers, device):
        self.model, self.optimizers, self.device = model, optimizers, device
        self.step, self.saved, self.scalars = None, [], []
        self.loss = math.inf  # the healthy loss that trusted it: a rollback measures spikes from there

    def _live(self):
        states = [state for opt in self.optimizers for state in opt.state.values()]
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return tensors + [v for state in states for v in state.values() if torch.is_tensor(v)], states

    def take(self, step):
        live, states = self._live()
        if [t.shape for t in self.saved] != [t.shape for t in live]:
            nbytes = sum(t.numel() * t.element_size() for t in live)
            cuda = self.device.type == "cuda"
            room = not cuda or torch.cuda.mem_get_info(self.device)[0] > 4 * nbytes  # two snapshots, then margin
            where = self.device if room else torch.device("cpu")
            self.saved = [torch.empty_like(t, device=where, pin_memory=cuda and not room) for t in live]
        for saved, tensor in zip(self.saved, live):
            saved.copy_(tensor, non_blocking=True)
        # python numbers kept in optimizer state (a step count) travel by value; no state yet (step 0) is kept too
        self.scalars = [{k: v for k, v in state.items() if not torch.is_tensor(v)} for state in states]
        self.step = step

    def restore(self):
        if not self.scalars:  # taken before the first optimizer step: the optimizers start afresh
            for opt in self.optimizers:
                opt.state.clear()
        live, states = self._live()
        with torch.no_grad():
            for saved, tensor in zip(self.saved, live):
                tensor.copy_(saved, non_blocking=True)
        for state, scalars in zip(states, self.scalars):
            state.update(scalars)
        self.model.zero_grad(set_to_none=True)


class Guard:
    """At each host sync: take a snapshot when one is due and the loss is healthy, or say that the run diverged.
    A snapshot is trusted only once the next sync's loss, measured on the weights it holds and after, is healthy
    (a sync's loss is of the steps before it); until then it is pending, and a rollback goes to the trusted one. The
    first, of the initial weights, is taken before the clock and trusted."""

    def __init__(self, model, optimizers, device, say):
        self.model, self.optimizers, self.device, self.say = model, optimizers, device, say
        self.trusted, self.pending = Snapshot(model, optimizers, device), Snapshot(model, optimizers, device)
        self.trusted.take(0)
        self.last_snapshot_s = 0.0
        self.smoothed, self.best, self.high_syncs = None, math.inf, 0
        self.rollbacks = []  # one dict each, for the summary
        self.drop_batch_factor, self.halvings = False, 0

    def lr_scale(self, batch_factor):
        """The batch rule's LR factor after the rollbacks so far: the factor is dropped first, then the LR halves."""
        return (min(batch_factor, 1.0) if self.drop_batch_factor else batch_factor) * 0.5**self.halvings

    def diverged(self, loss):
        """None, or why this sync's mean loss (agreed over ranks) says the run diverged. A healthy one trusts the
        pending snapshot."""
        if not math.isfinite(loss):
            return "non-finite loss"
        self.high_syncs = self.high_syncs + 1 if loss > self.best + SPIKE_NATS else 0
        if self.high_syncs >= SPIKE_SYNCS:
            return (
                f"loss {loss:.3f}, {SPIKE_NATS:g}+ nats above the best smoothed {self.best:.3f} for {SPIKE_SYNCS} syncs"
            )
        if self.high_syncs == 0:
            self.smoothed = loss if self.smoothed is None else (1 - SMOOTHING) * self.smoothed + SMOOTHING * loss
            self.best = min(self.best, self.smoothed)
            if self.pending.step is not None:
                self.trusted, self.pending = self.pending, self.trusted
                self.pending.step, self.trusted.loss = None, loss
        return None

    def maybe_snapshot(self, step, elapsed):
        """A pending snapshot at this healthy sync, SNAPSHOT_EVERY_S after the last. Returns whether one was taken."""
        if self.high_syncs or self.pending.step is not None or elapsed - self.last_snapshot_s < SNAPSHOT_EVERY_S:
            return False
        self.pending.take(step)
        self.last_snapshot_s = elapsed
        return True

    def roll_back(self, step, why, batch_factor):
        """Restore the trusted snapshot and lower the LRs; False when the rollbacks are used up."""
        if len(self.rollbacks) >= MAX_ROLLBACKS:
            return False
        self.trusted.restore()
        if batch_factor > 1.0 and not self.drop_batch_factor:
            self.drop_batch_factor = True
        else:
            self.halvings += 1
        # spikes are measured from the restored weights' loss on (the initial weights': from the next sync's)
        self.high_syncs, self.smoothed, self.best, self.pending.step = 0, None, self.trusted.loss, None
        self.rollbacks.append(
            {"step": step, "to_step": self.trusted.step, "why": why, "lr_scale": round(self.lr_scale(batch_factor), 4)}
        )
        self.say(
            f"rollback {len(self.rollbacks)}/{MAX_ROLLBACKS} at step {step}: {why}; weights and optimizer state of "
            f"step {self.trusted.step} restored, LR x{self.lr_scale(batch_factor):.3g} from here, the data moves on"
        )
        return True

    def restore_for_the_final_save(self, diverged):
        """Before the final save: a run that diverged, or weights that are not finite, go back to the trusted one."""
        if diverged or not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            self.trusted.restore()
            self.say(f"the final checkpoint holds the weights of step {self.trusted.step}, the last trusted snapshot")

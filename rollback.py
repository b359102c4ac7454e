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
    """Weights and optimizer state, copied into buffers allocated once (again for state the optimizers create later):
    on the device when it has room (5.54 GB at l16w1024 against ~275 GB: plan.snapshot_bytes), else in pinned host
    memory. Optimizer state is held by identity, (optimizer, parameter) and key, never by position: state that appears
    after a snapshot (a parameter with no gradient until untie_at) is never paired with another's, and a restore
    removes it, so that it starts afresh as it first did."""

    def __init__(self, model, optimizers, device):
        self.model, self.optimizers, self.device = model, optimizers, device
        self.step, self.tokens = None, 0
        self.weights = []  # copies of the model's parameters and buffers, in order
        self.held = {}  # (optimizer, parameter index) that had state -> {key: a copy, or a python number (a count)}
        self.loss = math.inf  # the healthy loss that trusted it: a rollback measures spikes from there

    def _params(self):
        """(optimizer index, parameter index, parameter) of every parameter an optimizer steps."""
        return [
            (i, j, p)
            for i, opt in enumerate(self.optimizers)
            for j, p in enumerate(p for group in opt.param_groups for p in group["params"])
        ]

    def _buffers(self, tensors):
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        cuda = self.device.type == "cuda"
        room = not cuda or torch.cuda.mem_get_info(self.device)[0] > 4 * nbytes  # two snapshots, then margin
        where = self.device if room else torch.device("cpu")
        return [torch.empty_like(t, device=where, pin_memory=cuda and not room) for t in tensors]

    def take(self, step, tokens):
        weights = [*self.model.parameters(), *self.model.buffers()]
        if len(self.weights) != len(weights):
            self.weights = self._buffers(weights)
        live = {(i, j): self.optimizers[i].state[p] for i, j, p in self._params() if p in self.optimizers[i].state}
        tensors = [(ij, k, v) for ij, state in live.items() for k, v in state.items() if torch.is_tensor(v)]
        copies, fresh = {}, []
        for ij, k, v in tensors:  # a buffer of the last snapshot's is reused; new state gets its own
            copy = self.held.get(ij, {}).get(k)
            if torch.is_tensor(copy) and (copy.shape, copy.dtype) == (v.shape, v.dtype):
                copies[ij, k] = copy
            else:
                fresh.append((ij, k, v))
        if fresh:
            copies.update(zip([(ij, k) for ij, k, _ in fresh], self._buffers([v for *_, v in fresh])))
        # python numbers in optimizer state (a step count) travel by value
        self.held = {
            ij: {k: copies[ij, k] if torch.is_tensor(v) else v for k, v in state.items()} for ij, state in live.items()
        }
        for copy, tensor in zip(self.weights, weights):
            copy.copy_(tensor, non_blocking=True)
        for ij, k, v in tensors:
            copies[ij, k].copy_(v, non_blocking=True)
        self.step, self.tokens = step, tokens

    def restore(self):
        """The weights and optimizer state exactly as taken; state of a parameter or key the snapshot did not hold is
        removed (it starts afresh)."""
        with torch.no_grad():
            for tensor, copy in zip([*self.model.parameters(), *self.model.buffers()], self.weights):
                tensor.copy_(copy, non_blocking=True)
            for i, j, p in self._params():
                state, held = self.optimizers[i].state, self.held.get((i, j))
                if held is None:
                    state.pop(p, None)
                    continue
                live = state[p]
                for k in [k for k in live if k not in held]:
                    del live[k]
                for k, v in held.items():
                    if torch.is_tensor(v) and torch.is_tensor(live.get(k)) and live[k].shape == v.shape:
                        live[k].copy_(v, non_blocking=True)
                    else:  # a python number, or state gone since the snapshot
                        live[k] = v.to(p.device, copy=True) if torch.is_tensor(v) else v
        self.model.zero_grad(set_to_none=True)


class Guard:
    """At each host sync: take a snapshot when one is due and the loss is healthy, or say that the run diverged.
    A snapshot is trusted only once the next sync's loss, measured on the weights it holds and after, is healthy
    (a sync's loss is of the steps before it); until then it is pending, and a rollback goes to the trusted one. The
    first, of the initial weights, is taken before the clock and trusted."""

    def __init__(self, model, optimizers, device, say):
        self.model, self.optimizers, self.device, self.say = model, optimizers, device, say
        self.trusted, self.pending = Snapshot(model, optimizers, device), Snapshot(model, optimizers, device)
        self.trusted.take(0, 0)
        self.restored_at = None  # the loop's step at the last restore (the weights are the trusted ones until it moves)
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

    def maybe_snapshot(self, step, tokens, elapsed):
        """A pending snapshot at this healthy sync, SNAPSHOT_EVERY_S after the last. Returns whether one was taken."""
        if self.high_syncs or self.pending.step is not None or elapsed - self.last_snapshot_s < SNAPSHOT_EVERY_S:
            return False
        self.pending.take(step, tokens)
        self.last_snapshot_s = elapsed
        return True

    def roll_back(self, step, why, batch_factor):
        """Restore the trusted snapshot and lower the LRs; False when the rollbacks are used up."""
        if len(self.rollbacks) >= MAX_ROLLBACKS:
            return False
        self.trusted.restore()
        self.restored_at = step
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

    def restore_for_the_final_save(self, step, diverged):
        """Before the final save at this step: a run that diverged, or weights that are not finite, go back to the
        trusted snapshot (plain weights). Returns whether they did."""
        if diverged or not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            self.trusted.restore()
            self.restored_at = step
            self.say(f"the final checkpoint holds the weights of step {self.trusted.step}, the last trusted snapshot")
            return True
        return False

    def state_dict(self):
        """What a resumed run's guard takes on: the LR cuts, the rollbacks so far and the loss it measures spikes from;
        its snapshots are taken afresh, of the weights it resumes."""
        names = ("drop_batch_factor", "halvings", "rollbacks", "smoothed", "best", "high_syncs", "last_snapshot_s")
        return {name: getattr(self, name) for name in names} | {"trusted_loss": self.trusted.loss}

    def load_state_dict(self, state, step, tokens):
        """Go on at this step: the weights the guard was made with (resumed) are its trusted snapshot."""
        self.trusted.step, self.trusted.tokens, self.trusted.loss = step, tokens, state["trusted_loss"]
        for name, value in state.items():
            if name != "trusted_loss":
                setattr(self, name, value)

    def weights_of(self, step, tokens):
        """(step, tokens) the model's weights are from at this step of the loop: the trusted snapshot's when it was
        restored here and nothing trained since, else these."""
        return (self.trusted.step, self.trusted.tokens) if self.restored_at == step else (step, tokens)

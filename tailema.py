"""The tail EMA: an exponential moving average of the weights over the decay's last part, blended into them once,
before the final save, so that the checkpoint the organizers score holds (1 - blend) x weights + blend x EMA.

Under a decaying LR the last iterates orbit the minimum; their average sits closer to it, and a partial blend keeps
the last iterate's lead over the lagging average (modded-nanogpt's optimization track, records #45-#46: an EMA of
every weight but the token embedding with a time constant of 150 of ~2,720 steps, started 5 time constants before the
end, blended 0.6). Here the time constant is a fraction of the run's progress, as the schedule is: the average is
taken at host syncs (a lerp each, no host sync and no graph of its own) and weighs each by the progress since the
last. It holds one copy of those weights, from the window's start on.
"""

import math

import torch

WINDOW_HORIZONS = 5  # the average starts this many time constants before the end: its first weights fade to e^-5


class TailEMA:
    """blend 0: off (no copy, no work). The weights average over progress; reset() after a rollback."""

    def __init__(self, model, blend, horizon):
        self.blend, self.horizon = blend, horizon
        self.start = 1.0 - WINDOW_HORIZONS * horizon
        # the record's scope: every weight but the token embedding, whose rows move only when their token is seen
        self.params = [p for name, p in model.named_parameters() if name != "wte.weight"]
        self.average, self.progress, self.from_step = None, None, None

    def update(self, progress, step):
        """Take in the weights after `step`, at `progress` in [0, 1]: nothing before the window; at its start a copy."""
        if not self.blend or progress < self.start:
            return
        with torch.no_grad():
            if self.average is None:
                self.average = [p.detach().clone() for p in self.params]
                self.from_step = step
            elif progress > self.progress:
                weight = 1.0 - math.exp(-(progress - self.progress) / self.horizon)
                torch._foreach_lerp_(self.average, self.params, weight)
        self.progress = progress

    def state_dict(self):
        """The window's place; the average itself is saved with the weights (resume.py), when there is one."""
        return {"progress": self.progress, "from_step": self.from_step}

    def load_state_dict(self, state, average):
        self.progress, self.from_step, self.average = state["progress"], state["from_step"], average

    def reset(self):
        """A rollback restored older weights: the average of the ones the run walked back from is dropped."""
        self.average, self.progress, self.from_step = None, None, None

    def blend_in(self):
        """Blend the average into the weights, in place (every rank alike); returns what the weights now are, in
        words: the blend, or "plain" (off, stopped before the window, an average that is not finite, or one that is
        the weights themselves: taken afresh at the end, after a rollback at the last sync)."""
        if self.average is None or all(torch.equal(a, p) for a, p in zip(self.average, self.params)):
            return "plain"
        if not all(bool(torch.isfinite(a).all()) for a in self.average):
            return "plain (the tail EMA was not finite)"
        with torch.no_grad():
            torch._foreach_lerp_(self.params, self.average, self.blend)
        return (
            f"{1 - self.blend:g} x weights + {self.blend:g} x their tail EMA (time constant {self.horizon:g} of "
            f"the run, from step {self.from_step}; the token embedding plain)"
        )

"""The schedule, a function of the run's progress in [0, 1] (the clock's, or steps'): the LR fraction (warmup, stable,
linear decay to the floor) and Muon's momentum; and each group's LR from it, the batch rule and the
rollbacks so far. train.py calls these once per optimizer step."""

import math

from plan import MIN_TOKENS_PER_STEP


def schedule(progress_frac, hp):
    """(lr_frac, muon momentum) at progress in [0, 1]: warmup, stable, linear decay to the floor."""
    p = min(max(progress_frac, 0.0), 1.0)
    floor = hp.min_lr_frac
    if hp.warmup_frac > 0 and p < hp.warmup_frac:
        lr_frac = p / hp.warmup_frac
    elif hp.schedule == "cosine":
        lr_frac = floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * (p - hp.warmup_frac) / (1 - hp.warmup_frac)))
    elif p < 1.0 - hp.decay_frac:
        lr_frac = 1.0
    else:
        lr_frac = floor + (1.0 - floor) * (1.0 - p) / hp.decay_frac
    warm = min(p / hp.momentum_warmup_frac, 1.0) if hp.momentum_warmup_frac > 0 else 1.0
    momentum = hp.muon_momentum_start + warm * (hp.muon_momentum - hp.muon_momentum_start)
    return min(lr_frac, 1.0), momentum


def batch_lr_scale(step_tokens, hp, kind, muon=False):
    """The LR multiplier of a step of step_tokens for an AdamW group (or with muon=True a Muon group): 1, or with
    --lr_rule sqrt the square-root rule for adaptive optimizers (Malladi et al. 2022, "On the SDEs and Scaling Rules
    for Adaptive Gradient Algorithms") against the recipe's minimum batch, never below 1; sqrt_adam leaves Muon's."""
    if hp.lr_rule == "none" or (muon and hp.lr_rule == "sqrt_adam"):
        return 1.0
    return math.sqrt(max(step_tokens / MIN_TOKENS_PER_STEP[kind], 1.0))


def set_lrs(optimizers, hp, lr_frac, momentum, step_tokens, kind, after_rollbacks=lambda factor: factor):
    """Each group's LR for this step (its base LR x the schedule x its batch rule, as the rollbacks so far left it)
    and Muon's momentum; Muon's groups are the ones with a momentum."""
    for opt in optimizers:
        for group in opt.param_groups:
            if "base_lr" not in group:  # optimizers.Snoo: its own constant LR
                continue
            muon = "momentum" in group
            factor = after_rollbacks(batch_lr_scale(step_tokens, hp, kind, muon))
            group["lr"] = group["base_lr"] * lr_frac * factor
            if muon:
                group["momentum"] = momentum

"""Which optimizer steps which parameter (build_optimizers: Muon for the hidden matrices, a cautious fused AdamW for
the rest), and Snoo, the outer step over all of them every k steps."""

from collections import defaultdict

import torch
from torch import nn

from muon import Muon, cautious_decay_


class CautiousAdamW(torch.optim.AdamW):
    """torch's fused AdamW, plus a group key "cautious_wd": weight decay times the LR applied after the step, only
    where the Adam update (sign of exp_avg: the denominator is positive) and the weight have the same sign, as in
    modded-nanogpt's medium track. The groups' own "weight_decay" (torch's plain decoupled decay) stays 0."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            decay = group["lr"] * group.get("cautious_wd", 0.0)
            if not decay:
                continue
            for p in group["params"]:
                if p.grad is not None and "exp_avg" in self.state[p]:
                    cautious_decay_(p, self.state[p]["exp_avg"], decay)
        return loss


class Snoo(torch.optim.Optimizer):
    """Snoo, Sparse Nesterov Outer Optimizer (mnGPT medium #12; with update smoothing #14), stepped after the others.
    At every `every`-th step (the 1st, the every+1-th, ...: the record's count), the weights' move since the last
    outer step is a negative gradient of Nesterov SGD from the slow weights (m: torch SGD's buffer, negated):
        m = momentum * m + (w - slow);  w = slow + lr * ((w - slow) + momentum * m);  slow = w
    Its LR and momentum are constant: the schedule sets groups with a "base_lr", and this one has none. State, fp32 as
    the weights: "slow" (the weights at construction), "outer_momentum", "outer_steps"; elementwise, the same on every
    rank, and held by a rollback snapshot as any optimizer's state."""

    def __init__(self, params, lr=0.68, momentum=0.37, every=28):
        if not (lr > 0 and 0 <= momentum < 1 and every >= 1):
            raise ValueError(f"Snoo needs lr > 0, momentum in [0, 1) and every >= 1, got {lr}, {momentum}, {every}")
        super().__init__(params, dict(outer_lr=lr, outer_momentum=momentum, every=int(every)))
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].update(slow=p.detach().clone(), outer_momentum=torch.zeros_like(p), outer_steps=0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = group["params"]
            states = [self.state[p] for p in params]
            count = states[0]["outer_steps"]
            for state in states:
                state["outer_steps"] = count + 1
            if count % group["every"]:
                continue
            # in place on the (fp32) weights: no transient copy of them (2.1 GB at l16w1024)
            slow, moms = [s["slow"] for s in states], [s["outer_momentum"] for s in states]
            torch._foreach_sub_(params, slow)
            torch._foreach_mul_(moms, group["outer_momentum"])
            torch._foreach_add_(moms, params)
            torch._foreach_add_(params, moms, alpha=group["outer_momentum"])
            torch._foreach_mul_(params, group["outer_lr"])
            torch._foreach_add_(params, slow)
            torch._foreach_copy_(slow, params)
        return loss


def build_optimizers(
    model: nn.Module,
    *,
    muon_lr,
    embed_lr,
    head_lr,
    scalar_lr,
    muon_momentum=0.95,
    adam_betas=(0.8, 0.95),
    adam_eps=1e-10,
    muon_weight_decay=0.0,
    adam_weight_decay=0.0,
    ns_coeffs="quintic",
    normuon_beta2=0.0,
    update_smoothing=0.0,
    snoo=None,
    use_muon=True,
    hidden_adamw_lr=3e-3,
    tied_head=None,
) -> list[torch.optim.Optimizer]:
    """[Muon, AdamW] over model's trainable parameters by split_parameters's rule; every group has "name" and
    "base_lr". use_muon=False gives [AdamW] alone, the hidden matrices in a group "hidden" (lr=hidden_adamw_lr): the
    baseline that benchmarks compare Muon against. Weight decay is cautious and multiplied by the LR (Muon.step,
    CautiousAdamW): muon_weight_decay on the Muon group, adam_weight_decay on embed, head and hidden; never on scalars.
    normuon_beta2 > 0 makes the Muon group NorMuon (normuon_scale); update_smoothing > 0 smooths its orthogonalised
    updates (Muon). snoo=(lr, momentum, every) appends a Snoo over every trainable parameter, stepped last. AdamW is
    fused on every device: one kernel over all its tensors (on one CPU thread, 15 ms against 114 for the per-tensor
    loop over four 32K x 128 tables).
    """
    split = split_parameters(model, tied_head)
    if not use_muon:
        split["hidden"] = split.pop("muon")
    lrs = {"embed": embed_lr, "head": head_lr, "hidden": hidden_adamw_lr, "scalar": scalar_lr}
    optimizers = [adamw_for(model, split, lrs, adam_betas, adam_eps, adam_weight_decay)]
    if use_muon:
        muon = Muon(
            [dict(name="muon", params=split["muon"])],
            lr=muon_lr,
            momentum=muon_momentum,
            weight_decay=muon_weight_decay,
            cautious=True,
            ns_coeffs=ns_coeffs,
            normuon_beta2=normuon_beta2,
            update_smoothing=update_smoothing,
        )
        optimizers.insert(0, muon)
    if snoo is not None:
        optimizers.append(Snoo([p for p in model.parameters() if p.requires_grad], *snoo))
    return optimizers


def optimizers_for_run(model, hp, tied_head=None):
    """build_optimizers with a run's flags (config.Hyperparameters): what train.py and the benchmarks step."""
    return build_optimizers(
        model,
        use_muon=hp.optimizer == "muon",
        hidden_adamw_lr=hp.adamw_lr,
        muon_lr=hp.muon_lr,
        embed_lr=hp.embed_lr,
        head_lr=hp.head_lr,
        scalar_lr=hp.scalar_lr,
        muon_momentum=hp.muon_momentum_start,
        muon_weight_decay=hp.muon_weight_decay,
        adam_weight_decay=hp.adam_weight_decay,
        ns_coeffs=hp.ns_coeffs,
        normuon_beta2=hp.normuon_beta2,
        update_smoothing=hp.muon_smoothing,
        snoo=(hp.snoo_lr, hp.snoo_momentum, hp.snoo_every) if hp.snoo_lr else None,
        tied_head=tied_head,
    )


def split_parameters(model, tied_head=None):
    """{group name: parameters}. The rule, first match wins, each parameter once (a tied weight counts once):
      1. tied_head (an embedding that is also the output head:   -> AdamW "head"   (lr=head_lr)
         at the embedding LR the logits blow up), "lm_head.*"
      2. parameters of nn.Embedding modules                      -> AdamW "embed"  (lr=embed_lr)
      3. every other parameter with ndim >= 2                    -> Muon  "muon"   (lr=muon_lr)
      4. ndim < 2: gains, scalars, biases                        -> AdamW "scalar" (lr=scalar_lr, no weight decay)
    except what model.optimizer_groups() names: "gate" (AdamW, lr=scalar_lr x model.config.gate_lr_mult, no weight
    decay: the small gate matrices, as mnGPT #56 moved them from Muon to Adam) or "head" (rule 1). Embedding and head
    rows are per-token vectors, not hidden linear maps: orthogonalising them is not what Muon is for."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    named = model.optimizer_groups() if hasattr(model, "optimizer_groups") else {}  # the model's own exceptions
    split = defaultdict(list)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if named.get(name) == "gate":
            split["gate"].append(p)
        elif p is tied_head or name.startswith("lm_head.") or named.get(name) == "head":
            split["head"].append(p)
        elif id(p) in embedding_params:
            split["embed"].append(p)
        elif p.ndim >= 2:
            split["muon"].append(p)
        else:
            split["scalar"].append(p)
    return split


def adamw_for(model, split, lrs, betas, eps, weight_decay):
    """The fused CautiousAdamW over split's AdamW groups (empty ones left out), with the model's tie hooks."""
    gate_lr = lrs["scalar"] * getattr(getattr(model, "config", None), "gate_lr_mult", 1.0)
    adam_groups = [
        dict(name=name, params=split[name], lr=lr, base_lr=lr, cautious_wd=wd)
        for name, lr, wd in [
            ("embed", lrs["embed"], weight_decay),
            ("head", lrs["head"], weight_decay),
            ("hidden", lrs["hidden"], weight_decay),
            ("scalar", lrs["scalar"], 0.0),
            ("gate", gate_lr, 0.0),
        ]
        if split[name]
    ]
    adamw = CautiousAdamW(adam_groups, betas=betas, eps=eps, weight_decay=0.0, fused=True)
    if hasattr(model, "tie_grads"):  # a shared embedding and head (model.py's untie_at) are stepped as one weight
        adamw.register_step_pre_hook(lambda *_: model.tie_grads())
        adamw.register_step_post_hook(lambda *_: model.sync_tied())
    return adamw

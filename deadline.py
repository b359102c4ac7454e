"""The training budget under SLURM: the job's end, read once by rank 0 and broadcast, less --slurm_reserve_s for the
final save and exit, is the one deadline every rank derives its budget from; the budget is taken again right before
the clock starts, so however long the start-up took, it comes out of the training time, never out of the reserve."""

import math
import os
import subprocess
import time

import torch
import torch.distributed as dist


def slurm_end_time(say=print):
    """The SLURM job's end (unix seconds), or None outside SLURM or when it cannot be read (said)."""
    if "SLURM_JOB_END_TIME" in os.environ:
        try:
            end = float(os.environ["SLURM_JOB_END_TIME"])
        except ValueError:
            end = math.nan
        if not math.isfinite(end):
            say(f"warning: SLURM_JOB_END_TIME={os.environ['SLURM_JOB_END_TIME']!r} is not a time; no SLURM deadline")
            return None
        return end
    if "SLURM_JOB_ID" not in os.environ:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def training_deadline(hp, rank, device, world, say):
    """The unix time training ends by: --slurm_reserve_s before the SLURM job's end (inf outside SLURM), read once by
    rank 0 and broadcast, so that every rank derives its budget from one absolute time."""
    end = slurm_end_time(say) if rank == 0 else None
    deadline = math.inf if end is None else end - hp.slurm_reserve_s
    agreed = torch.tensor([deadline], dtype=torch.float64, device=device)
    if world > 1:
        dist.broadcast(agreed, src=0)
    return agreed.item()


def budget_until(deadline, hp, trained_s=0.0):
    """Seconds of training in all: --time_limit_min, or less when the deadline comes first (at least one more than
    trained_s, what jobs before this one trained). With --budget_spans_jobs the deadline ends a job, not the budget."""
    budget = hp.time_limit_min * 60.0
    if hp.budget_spans_jobs:
        return budget
    return max(min(budget, trained_s + deadline - time.time()), trained_s + 1.0)


def agreed_budget(run, trained_s=0.0):
    """The clock's budget, taken right before it starts: the work before it (checks, plan, model, step-0 save, warm
    collectives: tens of seconds at the event) comes out of the time to the deadline, never out of the reserve the
    final save needs. The smallest over ranks."""
    budget = torch.tensor([budget_until(run.deadline, run.hp, trained_s)], dtype=torch.float64, device=run.device)
    if run.world > 1:
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    budget_s = budget.item()
    job_ends = f"the SLURM job ends in {run.deadline + run.hp.slurm_reserve_s - time.time():.0f} s"
    if run.hp.budget_spans_jobs and math.isfinite(run.deadline):
        run.say(
            f"budget: {budget_s:.0f} s over jobs, {trained_s:.0f} s trained before this one; {job_ends}: this job "
            f"trains up to {run.hp.slurm_reserve_s:g} s before it, saves the state and stops (wall)"
        )
    elif budget_s < run.hp.time_limit_min * 60.0:
        run.say(
            f"budget: {budget_s:.0f} s, not {run.hp.time_limit_min:g} min: {job_ends} and the final save and exit "
            f"keep {run.hp.slurm_reserve_s:g} s"
        )
    return budget_s

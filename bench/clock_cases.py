"""The clock at the event's numbers, driven by a fake clock (no sleeping): what a wrong forecast costs.

    python bench/clock_cases.py

1. A first step (compilation) of 10-70% of the 600 s budget, the real step as forecast or 2x off either way:
   steps run, the share of the steps after the compile step that come before progress 0.6 (the stable phase of a 0.4
   decay: ~60% when progress follows the time after the compile step), where the run ended.
2. The event's plan (2,490,368 tokens/step = 32 x 19 x 1024 x 4, cap 5000) on a device 0.25x-4x the forecast speed:
   steps run, the final accumulation, the end.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import clock as C  # noqa: E402
from plan import make_plan  # noqa: E402

EVENT = dict(kind="cuda", world_size=32, budget_s=600.0, max_steps=5000, seq_len=1024, vocab_size=32000)
EVENT.update(batch_size=8, micro_batch=None, batch_tokens=None, matmul_rate=2250e12, efficiency=0.4)
EVENT.update(memory_bytes=288 * 2**30, bf16=True)


def drive(clock, unit_s, first_extra_s=0.0):
    """(steps, progress of each step, end seconds): the loop's calls with a step of unit_s x its accumulation."""
    step, elapsed, progress = 0, 0.0, []
    while True:
        if clock.due(step) and clock.sync(step, elapsed, 0.0, 0.0):
            return step, progress, elapsed
        done, accum = clock.begin_step(step)
        progress.append(done)
        elapsed += unit_s * accum + (first_extra_s if step == 0 else 0.0)
        step += 1


def event_clock(plan):
    """The loop's Clock for the event: 600 s, cap 5000, the plan's accumulation, forecast and floor."""
    return C.Clock(
        600.0, 5000, plan.grad_accum_steps, 1.0, may_replan=True, planned_step_s=plan.step_s, min_accum=plan.min_accum
    )


def main():
    plan, _ = make_plan(model="l16w1024", shape=None, tokens_per_param=20.0, **EVENT)
    print(f"plan: {plan.line()}\n")
    print("| first step (share of 600 s) | real step | steps | share before progress 0.6 | end (s) | last progress |")
    print("| --- | --- | --- | --- | --- | --- |")
    for share in (0.1, 0.33, 0.5, 0.7):
        for step_s in (plan.step_s, plan.step_s / 2, plan.step_s * 2):
            clock = event_clock(plan)
            steps, progress, end = drive(clock, step_s / plan.grad_accum_steps, share * 600.0)
            stable = sum(p < 0.6 for p in progress[1:]) / max(len(progress) - 1, 1)
            print(
                f"| {share:.0%} | {step_s * 1e3:.1f} ms | {steps:,} | {stable:.1%} | {end:.1f} | {progress[-1]:.2f} |"
            )
    print("\n| real step at accumulation 6 | steps run | final accumulation | end (s) |")
    print("| --- | --- | --- | --- |")
    for speed in (4.0, 2.0, 1.0, 0.5, 0.25):
        unit_s = plan.step_s / plan.grad_accum_steps / speed
        clock = event_clock(plan)
        steps, _, end = drive(clock, unit_s)
        print(f"| {unit_s * 6e3:.1f} ms ({1 / speed:g}x the forecast) | {steps:,} | {clock.accum} | {end:.1f} |")


if __name__ == "__main__":
    main()

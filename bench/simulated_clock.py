"""train.py on a simulated clock: each optimizer step takes --step_s (+-10%) of simulated time, a stall of 3-5 s
follows a --stall_share of them at random (seeded), so the clock's decisions (progress, hence LR and momentum, syncs,
the stop) are those of a loaded machine, made repeatable: the same seed gives the same run bit for bit, however fast
the arithmetic runs. With --blame N the weights after step N + 1 are scored on that step's next batch with each
tensor put back to its value after step N, one at a time: which change a spike rests on (accumulation 1: a step's
batch is its one micro-batch).

    python bench/simulated_clock.py --seed 1 --stop_at 30 -- --time_limit_min 2 --model l4w128
    python bench/simulated_clock.py --seed 1 --stop_at 30 --blame 20 -- --time_limit_min 2 --model l4w128

BENCHMARKS.md, "The quick start's spike, found": what it showed.
"""

import argparse
import pathlib
import random
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import launch  # noqa: E402
import train  # noqa: E402
from ranks import say_on_rank0  # noqa: E402
from headloss import head_loss  # noqa: E402


def simulate(args):
    rng, now = random.Random(args.seed), [1000.0]
    time.perf_counter = lambda: now[0]  # the loop's clock; wall time (time.time) is left alone
    launch.agreed_matmul_rate = lambda device, world: args.tflops * 1e12  # the plan's forecast, fixed too
    real_step, real_batch = train.Trainer.train_step, train.Trainer.next_batch
    kept = {"batches": {}, "weights": {}}

    def next_batch(trainer):
        batch = real_batch(trainer)
        kept["batches"][len(kept["batches"])] = batch[0]
        return batch

    def train_step(trainer):
        stepped = real_step(trainer)
        jitter = rng.uniform(0.9, 1.1)
        stall = rng.uniform(3.0, 5.0) if rng.random() < args.stall_share else 0.0
        now[0] += args.step_s * jitter + stall + (args.first_extra_s if trainer.step == 1 else 0.0)
        model = trainer.run.raw_model
        if args.blame is not None and trainer.step - 1 in (args.blame, args.blame + 1):
            kept["weights"][trainer.step - 1] = {k: v.clone() for k, v in model.state_dict().items()}
        if args.blame is not None and trainer.step == args.blame + 3:  # step blame + 2's batch taken
            blame(model, kept, args.blame)
        if trainer.step == args.stop_at:
            signal.raise_signal(signal.SIGTERM)  # save, validate, summary
        return stepped

    train.Trainer.train_step, train.Trainer.next_batch = train_step, next_batch


@torch.no_grad()
def blame(model, kept, step):
    """The loss on step + 2's batch at the weights after step + 1, with each tensor in turn as it was after step."""
    before, after = kept["weights"][step], kept["weights"][step + 1]
    x, y = kept["batches"][step + 2]
    live = {k: v.clone() for k, v in model.state_dict().items()}

    def loss(weights):
        model.load_state_dict(weights)
        return model(x, y, loss_fn=head_loss)[1].item()

    say = say_on_rank0  # above the progress bar
    say(
        f"blame: step {step + 2}'s batch: {loss(before):.3f} at the weights after step {step}, {loss(after):.3f} "
        f"after step {step + 1}; with one tensor put back:"
    )
    for name in after:
        say(f"  {name:32s} {loss({**after, name: before[name]}):.3f}")
    model.load_state_dict(live)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="seed of the step times and stalls")
    parser.add_argument("--step_s", type=float, default=1.2, help="simulated seconds of a step (the quick start's)")
    parser.add_argument("--stall_share", type=float, default=0.1, help="share of steps followed by a 3-5 s stall")
    parser.add_argument("--first_extra_s", type=float, default=3.0, help="extra simulated seconds of step 0")
    parser.add_argument("--tflops", type=float, default=0.149, help="the matmul rate the plan is made for")
    parser.add_argument("--stop_at", type=int, default=40, help="stop (as on SIGTERM) after this many steps")
    parser.add_argument("--blame", type=int, default=None, help="score each tensor's change at this step")
    args, train_args = parser.parse_known_args()
    simulate(args)
    train.main([a for a in train_args if a != "--"])


if __name__ == "__main__":
    main()

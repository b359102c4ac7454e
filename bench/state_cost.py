"""What the training state costs (resume.py): its bytes on disk and the seconds to save it (at once, and in the
background: what the loop waits for, then until it is complete) and to load it, for a model of the given shape with
the default optimizers after one step, in one process on this machine's disk.

    python bench/state_cost.py --model l4w128 --out /tmp/state_bench
    python bench/state_cost.py --model l16w1024 --out /tmp/state_bench     # the event's shape: ~9.5 GB, minutes on CPU
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from config import Hyperparameters  # noqa: E402
from model import GPTConfig, get_model  # noqa: E402
from optimizers import optimizers_for_run  # noqa: E402
from plan import shape_config  # noqa: E402
from resume import StateWriter, folder_bytes, load_state  # noqa: E402


def stepped_model(name, vocab_size=32000, seq_len=64):
    """The model and its optimizers after one step on random tokens (the optimizer state made)."""
    torch.manual_seed(0)
    config = {**GPTConfig().__dict__, **shape_config(name), "vocab_size": vocab_size, "seq_len": seq_len}
    model = get_model(config)
    hp = Hyperparameters()  # the run's default optimizers, as launch.py builds them
    optimizers = optimizers_for_run(model, hp)
    x = torch.randint(0, vocab_size, (1, seq_len))
    model(x, x)[1].backward()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return model, optimizers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="l4w128", help="a plan.LADDER name")
    parser.add_argument("--out", required=True, help="a scratch folder (emptied)")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model, optimizers = stepped_model(args.model)
    params = sum(p.numel() for p in model.parameters())
    writer = StateWriter(str(out / "checkpoint.pt"), 0, None)
    meta = {"step": 1, "stop_reason": None}
    start = time.perf_counter()
    writer.save(model, optimizers, None, [], meta, background=False)
    at_once = time.perf_counter() - start
    start = time.perf_counter()
    writer.save(model, optimizers, None, [], {**meta, "step": 2}, background=True)
    returned = time.perf_counter() - start
    writer.wait()
    complete = time.perf_counter() - start
    folder = next(p for p in (out / "checkpoint.pt.state").iterdir() if p.name.startswith("step-"))
    nbytes = folder_bytes(folder)
    start = time.perf_counter()
    load_state(str(folder), model, optimizers, None, [], None)
    loaded = time.perf_counter() - start
    print(
        f"{args.model}: {params / 1e6:.1f}M params, state {nbytes / 2**30:.3f} GiB ({nbytes / params:.2f} B a param); "
        f"save at once {at_once:.2f} s; in the background: returns in {returned:.2f} s, complete in {complete:.2f} s; "
        f"load {loaded:.2f} s"
    )


if __name__ == "__main__":
    main()

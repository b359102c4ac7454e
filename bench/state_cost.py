"""What the training state costs (resume.py): its bytes on disk and the seconds to save it (at once, and in the
background: what the loop waits for, then until it is complete) and to load it, for a model of the given shape with
the default optimizers after one step, in one process on this machine's disk.

    python bench/state_cost.py --model l4w128 --out /tmp/state_bench
    python bench/state_cost.py --model l16w1024 --out /tmp/state_bench     # the event's shape: ~5.6 GB, minutes on CPU
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPTConfig, get_model  # noqa: E402
from optimizers import build_optimizers  # noqa: E402
from plan import shape_config  # noqa: E402
from resume import StateWriter, folder_bytes, load_state  # noqa: E402


def stepped_model(name, vocab_size=32000, seq_len=64):
    """The model and its optimizers after one step on random tokens (the optimizer state made)."""
    torch.manual_seed(0)
    config = {**GPTConfig().__dict__, **shape_config(name), "vocab_size": vocab_size, "seq_len": seq_len}
    model = get_model(config)
    optimizers = build_optimizers(
        model,
        use_muon=True,
        hidden_adamw_lr=3e-3,
        muon_lr=0.025,
        embed_lr=0.6,
        head_lr=0.008,
        scalar_lr=0.04,
        muon_momentum=0.85,
        muon_weight_decay=1.2,
        adam_weight_decay=0.005,
        ns_coeffs="polar_express",
        normuon_beta2=0.95,
        tied_head=None,
    )
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

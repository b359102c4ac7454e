"""What a rollback snapshot costs on the clock: measured here, forecast at the event from copy bandwidth.

    python bench/snapshot_cost.py                    # l4w128 measured on this machine; l16w1024 forecast
    python bench/snapshot_cost.py --shape l6w256 --reps 20

A snapshot copies the weights and the optimizer state (Muon: one momentum buffer per hidden matrix; AdamW: two
moments per table, head and gain) into buffers allocated once, every rollback.SNAPSHOT_EVERY_S seconds on the clock.
Its share of a run is (seconds per copy) / SNAPSHOT_EVERY_S.
"""

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from model import get_model  # noqa: E402
from optimizers import build_optimizers  # noqa: E402
from plan import shape_config  # noqa: E402
from rollback import SNAPSHOT_EVERY_S, Snapshot  # noqa: E402


def snapshot_bytes(model):
    """Bytes of weights plus optimizer state, counted without allocating: Muon keeps one buffer per hidden matrix,
    AdamW two per other parameter (build_optimizers' split: 2-D and not an embedding or the head -> Muon)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = 0
    for name, p in model.named_parameters():
        muon = p.ndim >= 2 and id(p) not in tables and not name.startswith("lm_head")
        total += p.numel() * 4 * (2 if muon else 3)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="l4w128")
    parser.add_argument("--event_shape", default="l16w1024")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--copy_gb_s", type=float, default=2000.0, help="device-to-device copy GB/s for the forecast")
    args = parser.parse_args()
    config = {"vocab_size": 32000, "seq_len": 1024}
    model = get_model({**config, **shape_config(args.shape)})
    optimizers = build_optimizers(model, muon_lr=0.02, embed_lr=0.1, head_lr=0.01, scalar_lr=0.01)
    idx = torch.randint(0, 32000, (1, 64))
    model(idx, idx)[1].backward()  # one step, so that the optimizers hold their state
    for opt in optimizers:
        opt.step()
    snapshot = Snapshot(model, optimizers, torch.device("cpu"))
    snapshot.take(1)  # allocates
    start = time.perf_counter()
    for step in range(args.reps):
        snapshot.take(step)
    seconds = (time.perf_counter() - start) / args.reps
    nbytes = sum(t.numel() * t.element_size() for t in snapshot.saved)
    print(
        f"{args.shape} on CPU: {nbytes / 1e9:.3f} GB, {seconds * 1e3:.1f} ms a snapshot, "
        f"{seconds / SNAPSHOT_EVERY_S:.3%} of the clock at one every {SNAPSHOT_EVERY_S:g} s"
    )
    with torch.device("meta"):
        event = get_model({**config, **shape_config(args.event_shape)})
    event_bytes = snapshot_bytes(event)
    forecast = event_bytes / (args.copy_gb_s * 1e9)
    print(
        f"{args.event_shape} at the event: {event_bytes / 1e9:.2f} GB on the device (x2: trusted and pending), "
        f"~{forecast * 1e3:.1f} ms a snapshot at {args.copy_gb_s:g} GB/s, {forecast / SNAPSHOT_EVERY_S:.4%} of the "
        f"clock"
    )


if __name__ == "__main__":
    main()

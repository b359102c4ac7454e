"""Training throughput and model FLOPs utilisation on this machine, at the tiny and the default shape.

    python bench/throughput.py [--steps 8] [--threads 2]

MFU is measured against the machine's own sustained matmul rate (plan.measure_matmul_rate: fp32 on
CPU, bf16 on CUDA), since a CPU has no published peak. Each shape is a real train.py run on synthetic
data at the event's 32K vocabulary; the first step (warm-up) is left out of the rates.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from plan import measure_matmul_rate  # noqa: E402

SHAPES = {  # name: flags; --batch_tokens keeps the step at one micro-batch (the plan would fill the 30 minutes)
    "tiny l4w128 T256": "--n_layer 4 --n_embd 128 --n_head 4 --seq_len 256 --batch_size 16 --batch_tokens 4096",
    "default l12w768 T1024": "--n_layer 12 --n_embd 768 --n_head 6 --seq_len 1024 --batch_size 1 --batch_tokens 1024",
}


def measure(flags, steps, peak_tflops, threads):
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp, "data")
        subprocess.run(
            [sys.executable, str(REPO / "data_cli.py"), "synth", str(data), "--tokens", "2000000"],
            check=True,
            capture_output=True,
        )
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            "--data_dir",
            str(data),
            "--checkpoint_path",
            f"{tmp}/c.pt",
            "--max_steps",
            str(steps),
            "--time_limit_min",
            "30",
            "--val_tokens",
            "65536",
            "--val_eval_tokens",
            "8192",
            "--peak_tflops",
            str(peak_tflops),
            "--log_every_s",
            "0",
            "--save_every_min",
            "0",
            *flags.split(),
        ]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        rows = [json.loads(line) for line in pathlib.Path(tmp, "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "train_loss" in r and r["step"] > 1]
    tok_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
    mfu = sum(r["mfu"] for r in steady) / len(steady)
    summary = rows[-1]
    return {
        "tokens_per_s": tok_s,
        "mfu": mfu,
        "ms_per_step": 1000 * summary["tokens"] / summary["steps"] / tok_s,
        "first_step_s": summary["compile_s"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate = measure_matmul_rate(torch.device("cpu"), seconds=2.0)
    print(f"sustained fp32 matmul rate: {rate / 1e9:.1f} GFLOP/s ({args.threads} threads)")
    print(f"{'shape':<24} {'tok/s':>9} {'ms/step':>9} {'MFU':>7} {'first step s':>12}")
    for name, flags in SHAPES.items():
        r = measure(flags, args.steps, rate / 1e12, args.threads)
        print(f"{name:<24} {r['tokens_per_s']:9.0f} {r['ms_per_step']:9.1f} {r['mfu']:7.1%} {r['first_step_s']:12.2f}")


if __name__ == "__main__":
    main()

#!/bin/bash
# Real-SLURM check of submit_slurm.sh: install SLURM from Debian, run a one-node cluster on this machine,
# submit a CPU-mode job (2 gloo ranks) with sbatch --wait, and load the checkpoint it wrote.
# The two-node version is .ci/slurm_multinode_check.sh; the shared parts are in .ci/slurm_lib.sh.
#
#   .ci/slurm_check.sh
#   TRAIN_SCRIPT=/path/to/probe.py TRAIN_FLAGS="--max_steps 2" DATA_DIR=/path/to/tokens .ci/slurm_check.sh
set -euo pipefail

CI_NAME=slurm_check
CI_DIR=${CI_DIR:-/tmp/slurm-ci}
NPROC=${NPROC:-2}
DATA_DIR=${DATA_DIR:-}                      # empty: synthetic data; a folder: staged to node-local disk first
source "$(dirname "$0")/slurm_lib.sh"

start_munge
# One node = this machine with its real CPUs and memory (slurmd -C prints them in slurm.conf syntax), at 127.0.0.1.
write_conf 127.0.0.1 "$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN"
mkdir -p "$CI_DIR/spool/$(hostname -s)"
slurmd -D -f "$SLURM_CONF" >"$CI_DIR/slurmd.out" 2>&1 &
PIDS+=($!)
wait_idle 1

# The job's --time ends a hung run.
submit DATA_DIR="$DATA_DIR" STAGE_DATA=1 OUT_DIR="$CI_DIR/out" \
    sbatch --wait --nodes=1 --gpus-per-node=0 --time=4 --output="$CI_DIR/job-%j.out" submit_slurm.sh
say "job finished"
check_checkpoint "$CI_DIR/out/checkpoint.pt"

# A budget over jobs (submit_slurm.sh's REQUEUE=1): a one-minute wall for a budget it cannot hold. Each run of the job
# trains up to its wall less the reserve, saves the state, and requeues the job; the next goes on from the state, until
# the run ends on its budget. --open-mode=append keeps every run's lines in the one log.
TRAIN_FLAGS="--n_layer 1 --n_head 2 --n_embd 32 --seq_len 32 --vocab_size 256 --batch_size 2 --val_tokens 2048 \
--slurm_reserve_s 20 --save_every_min 0.1" TIME_LIMIT_MIN=0.8 submit REQUEUE=1 DATA_DIR= OUT_DIR="$CI_DIR/spans" \
    sbatch --wait --requeue --open-mode=append --nodes=1 --gpus-per-node=0 --time=1 --output="$CI_DIR/spans-%j.out" \
    submit_slurm.sh
python3 - "$CI_DIR/spans/metrics.jsonl" <<'PY'
import json, sys
summary = json.loads(open(sys.argv[1]).read().splitlines()[-1])
reasons = [job["stop_reason"] for job in summary["jobs"]]
assert len(reasons) >= 2 and set(reasons[:-1]) == {"wall"} and reasons[-1] == "time_limit", reasons
assert summary["stop_reason"] == "time_limit" and summary["final_lr_frac"] <= 0.15, summary
print(f"slurm_check: the budget over {len(reasons)} runs of one job: {reasons}, {summary['train_s']} s trained")
PY
say "requeued job finished"
check_checkpoint "$CI_DIR/spans/checkpoint.pt"

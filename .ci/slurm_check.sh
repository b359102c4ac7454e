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

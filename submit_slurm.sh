#!/bin/bash
# Speedrun launch: one srun task per node, each running torchrun; c10d rendezvous on the first node.
#
#   sbatch submit_slurm.sh [train.py flags...]                  # 4 nodes x 8 GPUs, 12 min, data /home/data
#   sbatch --nodes=2 --gpus-per-node=4 --time=30 --partition=P submit_slurm.sh --seq_len 1024
#   DATA_DIR=/home/data STAGE_DATA=1 OUT_DIR=/home/$USER/runs sbatch submit_slurm.sh
#   CPU=1 NPROC=2 DATA_DIR= sbatch --nodes=1 --gpus-per-node=0 submit_slurm.sh   # gloo test run, no GPUs
#
# #SBATCH lines cannot read env vars, so nodes/GPUs/time/partition are overridden on the sbatch command
# line (or SBATCH_PARTITION, SBATCH_TIMELIMIT, SBATCH_GPUS_PER_NODE). Everything else is an env var below;
# sbatch exports the submitting environment, so any NCCL_* you set also reaches every rank.
# Submit from the repo root (or set REPO_DIR): sbatch runs a spooled copy of this file, not this path.
#
#SBATCH --job-name=speedrun
#SBATCH --nodes=4
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:12:00
#SBATCH --output=%x-%j.out
set -euo pipefail

REPO_DIR=${REPO_DIR:-$SLURM_SUBMIT_DIR}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$REPO_DIR/train.py}
DATA_DIR=${DATA_DIR-/home/data}             # set to empty for train.py's built-in synthetic data
OUT_DIR=${OUT_DIR:-$REPO_DIR/runs/$SLURM_JOB_ID}   # shared storage: the checkpoint must outlive the nodes
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$OUT_DIR/checkpoint.pt}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-10}        # training budget; the rest of the wall time is startup/staging
RDZV_PORT=${RDZV_PORT:-29500}
# The first node hosts the c10d store; RDZV_HOST overrides when node names are not resolvable hosts.
HEAD=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}

if [[ "${CPU:-0}" == 1 ]]; then
    NPROC=${NPROC:-1}
    DEVICE_FLAGS=(--device cpu)             # train.py then uses gloo
else
    NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-8}}   # one process per allocated GPU
    DEVICE_FLAGS=()
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}   # errors and warnings only; INFO when debugging the fabric
fi

# Copy the data to node-local disk before torchrun starts, so the training clock never waits on NFS.
if [[ -n "$DATA_DIR" && "${STAGE_DATA:-0}" == 1 ]]; then
    LOCAL_DIR=${LOCAL_DATA:-/tmp}/speedrun-data-$SLURM_JOB_ID
    srun --ntasks-per-node=1 mkdir -p "$LOCAL_DIR"
    srun --ntasks-per-node=1 cp -r "$DATA_DIR/." "$LOCAL_DIR/"
    trap 'srun --ntasks-per-node=1 rm -rf "$LOCAL_DIR"' EXIT   # leave the shared nodes' disks clean
    DATA_DIR=$LOCAL_DIR
fi
DATA_FLAGS=()
if [[ -n "$DATA_DIR" ]]; then DATA_FLAGS=(--data_dir "$DATA_DIR"); fi

mkdir -p "$OUT_DIR"
echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES nodes x $NPROC procs, head $HEAD:$RDZV_PORT, data '${DATA_DIR}', out $OUT_DIR"

# --cpu-bind=none: one task per node holds all ranks, so SLURM must not pin it to a single core.
srun --ntasks-per-node=1 --cpu-bind=none \
    torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$RDZV_PORT" --rdzv_id="$SLURM_JOB_ID" \
    "$TRAIN_SCRIPT" "${DATA_FLAGS[@]}" --checkpoint_path "$CHECKPOINT_PATH" \
    --time_limit_min "$TIME_LIMIT_MIN" "${DEVICE_FLAGS[@]}" "$@"

#!/bin/bash
# Speedrun launch: one srun task per node, each running torchrun; c10d rendezvous on the first node.
#
#   sbatch submit_slurm.sh [train.py flags...]                  # 4 nodes x 8 GPUs, 12 min, data /home/data
#   sbatch --nodes=2 --gpus-per-node=4 --time=30 --partition=P submit_slurm.sh --seq_len 1024
#   DATA_DIR=/home/data STAGE_DATA=1 OUT_DIR=/home/$USER/runs sbatch submit_slurm.sh
#   NCCL_SOCKET_IFNAME=ib0 sbatch submit_slurm.sh               # the interface the nodes reach each other on
#   CPU=1 NPROC=2 DATA_DIR= sbatch --nodes=1 --gpus-per-node=0 submit_slurm.sh   # gloo test run, no GPUs
#   REQUEUE=1 TIME_LIMIT_MIN=960 sbatch --requeue --signal=B:USR1@120 --time=4:00:00 submit_slurm.sh
#                                                               # a 16-hour budget over 4-hour jobs (README: Longer runs)
#
# #SBATCH lines cannot read env vars, so nodes/GPUs/time/partition are overridden on the sbatch command
# line (or SBATCH_PARTITION, SBATCH_TIMELIMIT, SBATCH_GPUS_PER_NODE). Everything else is an env var below;
# sbatch exports the submitting environment and srun --export=ALL hands it on, so any NCCL_* or GLOO_* you set
# (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME: the interface other nodes reach, see README) reaches every rank.
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
# The first node hosts the c10d store; RDZV_HOST overrides when node names are not resolvable hosts.
HEAD=${RDZV_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
# torchrun waits RDZV_TIMEOUT seconds for every node's torchrun (its own default, 600 s, is most of the wall)
RDZV_TIMEOUT=${RDZV_TIMEOUT:-120}
# The job log may go away (a full disk, a `| tee` killed by scancel): a log line never ends the job. Each is written
# in a subshell that ignores SIGPIPE (so the shell gets EPIPE, not killed), stdout first, else stderr, else dropped.
say() { (trap '' PIPE; echo "$*") 2>/dev/null || say_err "$*"; }
say_err() { (trap '' PIPE; echo "$*" >&2) || true; }

# A busy rendezvous port hangs torchrun silently past any timeout (it talks to whatever holds the port): this
# script runs on the head node, so it checks the port there, and moves off the default one when another job has it.
port_free() { python3 -c 'import socket, sys; socket.socket().bind(("", int(sys.argv[1])))' "$1" 2>/dev/null; }
if [[ -z "${RDZV_HOST:-}" && "$(hostname -s)" == "${HEAD%%.*}" ]]; then
    if [[ -n "${RDZV_PORT:-}" ]] && ! port_free "$RDZV_PORT"; then
        say_err "error: RDZV_PORT $RDZV_PORT is in use on $HEAD; unset RDZV_PORT to let the job choose one" >&2
        exit 2
    fi
    if [[ -z "${RDZV_PORT:-}" ]]; then
        for RDZV_PORT in $(seq 29500 29599); do port_free "$RDZV_PORT" && break; done
        [[ $RDZV_PORT == 29500 ]] || say "rendezvous: port 29500 is in use on $HEAD; using $RDZV_PORT"
    fi
fi
RDZV_PORT=${RDZV_PORT:-29500}

if [[ "${CPU:-0}" == 1 ]]; then
    NPROC=${NPROC:-1}
    DEVICE_FLAGS=(--device cpu)             # train.py then uses gloo
else
    NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-8}}   # one process per allocated GPU
    DEVICE_FLAGS=()
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}   # errors and warnings only; INFO when debugging the fabric
fi

mkdir -p "$OUT_DIR"
say "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES nodes x $NPROC procs, head $HEAD:$RDZV_PORT, data '${DATA_DIR}', out $OUT_DIR"

# The fabric: which interface the ranks' sockets use (NCCL's bootstrap and TCP, gloo's collectives); each library
# picks one itself when unset. --export=ALL hands them, and all the rest, to the ranks on every node.
FABRIC=$(env | grep -E '^(NCCL|GLOO)_[A-Z_]*=' | sort | paste -sd ' ' || true)
say "fabric: ${FABRIC:-library defaults (no NCCL_* or GLOO_* set)}"

# Stage to node-local disk before torchrun starts, so the training clock never waits on shared storage: only what
# this node's ranks can read (stage.py: their blocks for the plan's tokens x STAGE_MARGIN, default 1.5, the
# validation range, the start-up check's sample), since the whole folder would not copy within the wall. The plan
# is made once, here; torchrun numbers the nodes by their names (fqdn), so stage.py gets every node's.
if [[ -n "$DATA_DIR" && "${STAGE_DATA:-0}" == 1 ]]; then
    LOCAL_DIR=${LOCAL_DATA:-/tmp}/speedrun-data-$SLURM_JOB_ID
    PLAN=$(python3 "$TRAIN_SCRIPT" --data_dir "$DATA_DIR" --time_limit_min "$TIME_LIMIT_MIN" "${DEVICE_FLAGS[@]}" \
        "$@" --dry_run --world_size $((SLURM_JOB_NUM_NODES * NPROC)) | grep '^{' | tail -n 1)
    NODE_NAMES=$(srun --ntasks-per-node=1 python3 -c 'import socket; print(socket.getfqdn())' | sort | paste -sd ,)
    trap 'srun --ntasks-per-node=1 rm -rf "$LOCAL_DIR"' EXIT   # leave the shared nodes' disks clean
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL python3 "$REPO_DIR/stage.py" "$DATA_DIR" "$LOCAL_DIR" \
        --plan "$PLAN" ${STAGE_MARGIN:+--margin "$STAGE_MARGIN"} --nodes "$NODE_NAMES" --nproc "$NPROC" -- "$@"
    DATA_DIR=$LOCAL_DIR
fi
DATA_FLAGS=()
if [[ -n "$DATA_DIR" ]]; then DATA_FLAGS=(--data_dir "$DATA_DIR"); fi

# --cpu-bind=none: one task per node holds all ranks, so SLURM must not pin it to a single core.
# --kill-on-bad-exit: a node whose torchrun fails ends the step on every node now, not at a collective timeout or
# the wall; the wrapper names that node in one line.
# REQUEUE=1: the budget spans jobs. Each job trains up to its wall (less --slurm_reserve_s), saves the training state
# beside the checkpoint and exits; this script then requeues the job (the same id, so the same OUT_DIR), and the
# next run of it goes on from the state (--resume auto), until the run ends on its budget. USR1 (sbatch
# --signal=B:USR1@SECONDS) stops training early, for a wall that comes sooner than SLURM_JOB_END_TIME said.
SPAN_FLAGS=()
if [[ "${REQUEUE:-0}" == 1 ]]; then SPAN_FLAGS=(--budget_spans_jobs); fi
NEAR_WALL=0
srun --ntasks-per-node=1 --cpu-bind=none --kill-on-bad-exit=1 --export=ALL \
    bash -c 'torchrun "$@"; rc=$?; trap "" PIPE; line="node $(hostname): torchrun exited $rc"
        echo "$line" 2>/dev/null || echo "$line" >&2; exit $rc' node \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$RDZV_PORT" --rdzv_id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" \
    --rdzv_conf=join_timeout="$RDZV_TIMEOUT" \
    "$TRAIN_SCRIPT" "${DATA_FLAGS[@]}" --checkpoint_path "$CHECKPOINT_PATH" \
    --time_limit_min "$TIME_LIMIT_MIN" "${DEVICE_FLAGS[@]}" "${SPAN_FLAGS[@]}" "$@" &
STEP=$!
# bash runs a trap only between commands: wait returns on a signal, and is waited again for the step's exit code
trap 'NEAR_WALL=1; say "USR1: the wall is near; the ranks stop, save and exit"; kill -TERM $STEP 2>/dev/null' USR1
trap 'kill -TERM $STEP 2>/dev/null' TERM
while true; do
    wait $STEP && STATUS=0 || STATUS=$?
    kill -0 $STEP 2>/dev/null || break
done
if [[ "${REQUEUE:-0}" == 1 && $STATUS == 0 ]]; then
    METRICS=${METRICS_PATH:-$(dirname "$CHECKPOINT_PATH")/metrics.jsonl}
    REASON=$(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1]).get("stop_reason"))' \
        "$METRICS" 2>/dev/null) || REASON=none
    if [[ $REASON == wall || ($REASON == signal && $NEAR_WALL == 1) ]]; then
        say "job $SLURM_JOB_ID (run ${SLURM_RESTART_COUNT:-0}): stopped for its wall; requeued to go on from the state"
        scontrol requeue "$SLURM_JOB_ID"
    else
        say "job $SLURM_JOB_ID: the run ended ($REASON); not requeued"
    fi
fi
exit $STATUS

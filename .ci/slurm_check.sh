#!/bin/bash
# Real-SLURM check of submit_slurm.sh: install SLURM from Debian, run a one-node cluster on this machine,
# submit a CPU-mode job (2 gloo ranks) with sbatch --wait, and load the checkpoint it wrote.
# For a throwaway Debian 12 machine, as root, without systemd (daemons are started directly).
#
#   .ci/slurm_check.sh
#   TRAIN_SCRIPT=/path/to/probe.py TRAIN_FLAGS="--max_steps 2" DATA_DIR=/path/to/tokens .ci/slurm_check.sh
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$REPO/train.py}
TRAIN_FLAGS=${TRAIN_FLAGS:---n_layer 1 --n_head 2 --n_embd 32 --seq_len 32 --vocab_size 256 --batch_size 2 --max_steps 3 --val_tokens 2048}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-0.2}
NPROC=${NPROC:-2}
DATA_DIR=${DATA_DIR:-}                      # empty: synthetic data; a folder: staged to node-local disk first
CI_DIR=${CI_DIR:-/tmp/slurm-ci}             # all cluster state lives here; /etc/slurm is left alone
export SLURM_CONF=$CI_DIR/slurm.conf
T0=$SECONDS
[[ $EUID == 0 ]] || { echo "slurm_check: run as root (it installs packages and starts daemons)"; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
echo "slurm_check: SLURM installed ($((SECONDS - T0)) s)"

rm -rf "$CI_DIR" && mkdir -p "$CI_DIR/state" "$CI_DIR/spool" "$CI_DIR/out"
PIDS=()

finish() {
    local status=$?
    if [[ $status != 0 ]]; then
        for log in "$CI_DIR"/job-*.out; do echo "===== $log"; cat "$log"; done
        for log in "$CI_DIR"/*.log; do echo "===== $log"; tail -n 30 "$log"; done
    fi
    # Cancel the job first: without cgroups, killing slurmd would orphan its processes.
    if [[ ${#PIDS[@]} -gt 0 ]]; then
        scancel --quiet --partition=ci 2>/dev/null || true
        for _ in $(seq 20); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.5; done
        kill "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
    echo "slurm_check: $([[ $status == 0 ]] && echo PASS || echo FAIL) in $((SECONDS - T0)) s"
    exit "$status"
}
trap finish EXIT
trap 'exit 143' TERM INT                    # a killed check must still run finish and stop the daemons

# Reuse a munged that is already answering (e.g. started by the package); otherwise start our own.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged --foreground >"$CI_DIR/munged.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# One node = this machine with its real CPUs and memory (slurmd -C prints them in slurm.conf syntax).
# linuxproc + affinity: no cgroup setup needed, which containers and cgroup-v1/v2 hybrids often lack.
cat >"$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$CI_DIR/state
SlurmdSpoolDir=$CI_DIR/spool
SlurmctldPidFile=$CI_DIR/slurmctld.pid
SlurmdPidFile=$CI_DIR/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -c -f "$SLURM_CONF" >"$CI_DIR/slurmctld.log" 2>&1 &
PIDS+=($!)
slurmd -D -f "$SLURM_CONF" >"$CI_DIR/slurmd.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 60); do [[ "$(sinfo -h -o %T 2>/dev/null)" == idle ]] && break; sleep 0.5; done
[[ "$(sinfo -h -o %T)" == idle ]] || { echo "slurm_check: node never became idle"; sinfo; exit 1; }
echo "slurm_check: cluster up ($((SECONDS - T0)) s)"

# The job's --time ends a hung run. sbatch runs in the background because bash defers traps
# until a foreground command returns, while `wait` returns as soon as a signal arrives.
cd "$REPO"
# shellcheck disable=SC2086  # TRAIN_FLAGS is a flag list and must split into words
CPU=1 NPROC=$NPROC DATA_DIR="$DATA_DIR" STAGE_DATA=1 OUT_DIR="$CI_DIR/out" \
    TRAIN_SCRIPT="$TRAIN_SCRIPT" TIME_LIMIT_MIN=$TIME_LIMIT_MIN \
    sbatch --wait --nodes=1 --gpus-per-node=0 --time=4 --output="$CI_DIR/job-%j.out" \
    submit_slurm.sh $TRAIN_FLAGS &
PIDS+=($!)
wait $!
echo "slurm_check: job finished ($((SECONDS - T0)) s)"
[[ -f "$CI_DIR/out/checkpoint.pt" ]] || { echo "slurm_check: the job wrote no $CI_DIR/out/checkpoint.pt"; exit 1; }

"${PYTHON:-python3}" - "$CI_DIR/out/checkpoint.pt" <<'EOF'
import sys, torch
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
assert isinstance(ckpt.get("model"), dict) and ckpt["model"], "checkpoint has no model state_dict"
assert isinstance(ckpt.get("config"), dict), "checkpoint has no config dict"
print(f"slurm_check: checkpoint loads: {len(ckpt['model'])} tensors, config {ckpt['config']}")
EOF

# Shared parts of the real-SLURM checks, sourced by .ci/slurm_check.sh (one node) and
# .ci/slurm_multinode_check.sh (two nodes): SLURM and munge, slurm.conf, the job, the organizers' checkpoint
# load, and the cleanup on exit. For a throwaway Debian 12 machine, as root, without systemd.
# The sourcing script sets CI_NAME, CI_DIR (all cluster state lives there; /etc/slurm is left alone) and NPROC.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$REPO/train.py}
TRAIN_FLAGS=${TRAIN_FLAGS:---n_layer 1 --n_head 2 --n_embd 32 --seq_len 32 --vocab_size 256 --batch_size 2 --max_steps 3 --val_tokens 2048}
TIME_LIMIT_MIN=${TIME_LIMIT_MIN:-0.2}
export SLURM_CONF=$CI_DIR/slurm.conf
T0=$SECONDS
PIDS=()     # daemons and the waiting sbatch, stopped on exit
CLEANUP=()  # more commands for the exit, run after the daemons stop (the two-node network)

say() { echo "$CI_NAME: $* ($((SECONDS - T0)) s)"; }

finish() {
    local status=$? step
    if [[ $status != 0 ]]; then
        for log in "$CI_DIR"/*-[0-9]*.out; do [[ -f $log ]] && { echo "===== $log"; cat "$log"; }; done  # the jobs
        for log in "$CI_DIR"/*.log; do [[ -f $log ]] && { echo "===== $log"; tail -n 30 "$log"; }; done
    fi
    # Cancel the jobs first: without cgroups, killing slurmd would orphan its processes.
    if [[ ${#PIDS[@]} -gt 0 ]]; then
        scancel --quiet --partition=ci 2>/dev/null || true
        for _ in $(seq 20); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.5; done
        kill "${PIDS[@]}" 2>/dev/null || true
        wait "${PIDS[@]}" 2>/dev/null || true
    fi
    for step in "${CLEANUP[@]}"; do eval "$step" || true; done
    echo "$CI_NAME: $([[ $status == 0 ]] && echo PASS || echo FAIL) in $((SECONDS - T0)) s"
    exit "$status"
}
trap finish EXIT
trap 'exit 143' TERM INT  # a killed check must still run finish and stop the daemons

[[ $EUID == 0 ]] || { echo "$CI_NAME: run as root (it installs packages and starts daemons)"; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
say "SLURM installed"
rm -rf "$CI_DIR" && mkdir -p "$CI_DIR/state" "$CI_DIR/spool" "$CI_DIR/out"

# Reuse a munged that is already answering (e.g. started by the package); otherwise start our own.
start_munge() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged --foreground >"$CI_DIR/munged.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
}

# slurm.conf for a controller at address $1 and the node lines $2, and the controller. linuxproc + affinity: no
# cgroup setup, which containers often lack. Per-node spool, pid and log paths (%n) let several slurmd share this
# machine; each node's spool folder is made by the script that starts its slurmd.
write_conf() {
    cat >"$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=$(hostname -s)($1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$CI_DIR/state
SlurmdSpoolDir=$CI_DIR/spool/%n
SlurmctldPidFile=$CI_DIR/slurmctld.pid
SlurmdPidFile=$CI_DIR/slurmd-%n.pid
SlurmdLogFile=$CI_DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
$2
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    slurmctld -D -c -f "$SLURM_CONF" >"$CI_DIR/slurmctld.log" 2>&1 &
    PIDS+=($!)
}

wait_idle() {  # $1 nodes
    for _ in $(seq 60); do
        [[ "$(sinfo -h -o %T 2>/dev/null)" == idle && "$(sinfo -h -o %D)" == "$1" ]] && break
        sleep 0.5
    done
    [[ "$(sinfo -h -o %T)" == idle ]] || { echo "$CI_NAME: the nodes never became idle"; sinfo; exit 1; }
    say "cluster up: $(sinfo -h -o '%D nodes %N')"
}

# sbatch --wait of submit_slurm.sh with the env assignments and sbatch flags given, then TRAIN_FLAGS. sbatch runs
# in the background because bash defers traps until a foreground command returns, while `wait` returns as soon as
# a signal arrives. Returns sbatch's status (the job's exit code).
submit() {
    cd "$REPO"
    # shellcheck disable=SC2086  # TRAIN_FLAGS is a flag list and must split into words
    env CPU=1 NPROC="$NPROC" TRAIN_SCRIPT="$TRAIN_SCRIPT" TIME_LIMIT_MIN="$TIME_LIMIT_MIN" "$@" $TRAIN_FLAGS &
    PIDS+=($!)
    wait $!
}

# The organizers' load: torch.load(weights_only=True), get_model(ckpt["config"]) from model.py, load_state_dict.
check_checkpoint() {
    [[ -f $1 ]] || { echo "$CI_NAME: the job wrote no $1"; exit 1; }
    (cd "$REPO" && "${PYTHON:-python3}" - "$1" "$CI_NAME") <<'EOF'
import sys, torch
from model import get_model
ckpt = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
model = get_model(ckpt["config"])
model.load_state_dict(ckpt["model"])
n, world = len(ckpt["model"]), ckpt["config"]["plan"]["world_size"]
print(f"{sys.argv[2]}: checkpoint loads with model.py alone: {n} tensors, step {ckpt['step']}, world {world}")
EOF
}

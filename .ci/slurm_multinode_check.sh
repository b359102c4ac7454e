#!/bin/bash
# Real two-node SLURM check of submit_slurm.sh on one machine. Each node is its own network namespace with its own
# hostname and address (a veth on a bridge, a private /24), its own mount namespace (node-local disk) and its own
# slurmd; slurmctld and munge are shared, /etc/hosts names the nodes. Nothing leaves the bridge and loopback; the
# namespaces, links, /etc/hosts lines and daemons are removed on exit, also on failure.
#   1. the job as users submit it: sbatch --wait --nodes=2 submit_slurm.sh, CPU mode, 2 gloo ranks per node, the
#      default rendezvous (the first node's hostname), data staged to each node's local disk, the checkpoint on
#      storage both nodes see, loaded with the organizers' snippet;
#   2. a node that dies before training: the job ends in one message naming it, well before its wall.
#
#   .ci/slurm_multinode_check.sh
#   CI_NET=10.99.7 .ci/slurm_multinode_check.sh      # another private /24 if 10.250.81.0/24 is taken here
set -euo pipefail

CI_NAME=slurm_multinode_check
CI_DIR=${CI_DIR:-/tmp/slurm-ci-2node}
NET=${CI_NET:-10.250.81}                    # .1 the controller on the bridge, .11 and .12 the nodes
BRIDGE=srci0
NODES=(ci-node1 ci-node2)
NPROC=2
export GLOO_SOCKET_IFNAME=ci0               # the nodes' one interface: what a user sets for their fabric
source "$(dirname "$0")/slurm_lib.sh"

# The network, /etc/hosts lines and node-local disks of a previous run of this check, if any, then ours at exit.
teardown() {
    local node pid hosts
    for node in "${NODES[@]}"; do
        if [[ -e /run/netns/$node ]]; then
            for pid in $(ip netns pids "$node"); do kill -KILL "$pid" 2>/dev/null || true; done
            ip netns del "$node"
        fi
        ip link del "v-$node" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    hosts=$(grep -v " # $CI_NAME\$" /etc/hosts || true)
    printf '%s\n' "$hosts" >/etc/hosts      # rewritten in place: /etc/hosts may be a bind mount
}
teardown
CLEANUP+=(teardown)

# One line saying why, then exit 1, when this machine cannot make the network.
must() {
    local err
    if ! err=$("$@" 2>&1); then
        echo "$CI_NAME: cannot build the two-node network here: '$*' failed: ${err//$'\n'/ }"
        exit 1
    fi
}
must ip link add "$BRIDGE" type bridge
must ip addr add "$NET.1/24" dev "$BRIDGE"
must ip link set "$BRIDGE" up
for i in "${!NODES[@]}"; do
    node=${NODES[i]}
    must ip netns add "$node"
    must ip link add "v-$node" type veth peer name "$GLOO_SOCKET_IFNAME" netns "$node"
    must ip link set "v-$node" master "$BRIDGE" up
    must ip -n "$node" addr add "$NET.$((11 + i))/24" dev "$GLOO_SOCKET_IFNAME"
    must ip -n "$node" link set "$GLOO_SOCKET_IFNAME" up
    must ip -n "$node" link set lo up
    echo "$NET.$((11 + i)) $node # $CI_NAME" >>/etc/hosts
    mkdir -p "$CI_DIR/disk/$node" "$CI_DIR/spool/$node" "$CI_DIR/local"
done
say "network up: ${NODES[*]} on $BRIDGE ($NET.0/24)"

start_munge
# Every node has this machine's CPUs and memory: slurmd -C's line under the nodes' names.
write_conf "$NET.1" "NodeName=ci-node[1-${#NODES[@]}] $(slurmd -C | head -n 1 | cut -d ' ' -f 2-) State=UNKNOWN"
# `ip netns exec` remounts /sys without the cgroup filesystem, which slurmd refuses; nsenter joins the network
# namespace only, unshare adds the node's hostname and a mount namespace whose $CI_DIR/local is this node's disk.
for node in "${NODES[@]}"; do
    # shellcheck disable=SC2016  # expanded by the node's shell
    nsenter --net="/run/netns/$node" unshare --uts --mount sh -c \
        'hostname "$1" && mount --bind "$2" "$3" && exec slurmd -D -N "$1" -f "$SLURM_CONF"' \
        node "$node" "$CI_DIR/disk/$node" "$CI_DIR/local" >"$CI_DIR/slurmd-$node.out" 2>&1 &
    PIDS+=($!)
done
wait_idle "${#NODES[@]}"

# --- 1. the job as users submit it
# 32 MB of tokens, far more than the run reads: each node stages its ranks' share (stage.py), not the folder.
"${PYTHON:-python3}" "$REPO/data_cli.py" synth "$CI_DIR/data" --tokens 16e6 --chunk_tokens 2e6 --vocab_size 256 \
    --n_states 254 >/dev/null
submit DATA_DIR="$CI_DIR/data" STAGE_DATA=1 LOCAL_DATA="$CI_DIR/local" OUT_DIR="$CI_DIR/out" \
    sbatch --wait --nodes=2 --gpus-per-node=0 --time=4 --output="$CI_DIR/job-%j.out" submit_slurm.sh
say "two-node job finished"
log=$(ls "$CI_DIR"/job-*.out)
first=$(head -n 1 "$log")
echo "$first"
[[ $first == "job "*": 2 nodes x 2 procs, head ci-node1:"* ]] || { echo "$CI_NAME: no two-node job line"; exit 1; }
grep -m 1 'on 4 rank(s)' "$log" || { echo "$CI_NAME: no summary of 4 ranks"; exit 1; }
for node in "${NODES[@]}"; do
    grep "^stage $node: ranks " "$log" || { echo "$CI_NAME: $node staged nothing"; exit 1; }
    grep "^node $node: torchrun exited 0" "$log" || { echo "$CI_NAME: no ranks ended on $node"; exit 1; }
done
check_checkpoint "$CI_DIR/out/checkpoint.pt"

# --- 2. a node that dies before training: its torchrun and ranks are killed once they have started (the data read
# from shared storage: staging is proven above). The job must end with one message naming it, and the other node's
# ranks must exit, within 60 s of the kill (a quarter of the wall): srun's --kill-on-bad-exit, then SLURM's
# KillWait (30 s) or the ranks' collective timeout (30 s here), whichever comes first.
cmdline() { { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null || true; }  # empty once the process is gone
kill_node() {
    local pid torchrun='' ranks=''
    for _ in $(seq 600); do
        for pid in $(ip netns pids "$1"); do  # torchrun is the child of submit_slurm.sh's per-node wrapper
            if [[ $(cmdline "$pid") == *"bash -c torchrun "* ]]; then
                torchrun=$(ps -o pid= --ppid "$pid" | xargs || true)
            fi
        done
        if [[ -n $torchrun ]]; then ranks=$(ps -o pid= --ppid "$torchrun" | xargs || true); fi
        if [[ $(wc -w <<<"$ranks") == "$NPROC" ]]; then
            for pid in $ranks; do  # the fabric variable went through srun to this node's ranks
                if grep -qz "^GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME\$" "/proc/$pid/environ"; then
                    echo "$pid" >>"$CI_DIR/fabric_ranks"
                fi
            done
            # shellcheck disable=SC2086  # one pid a word
            kill -KILL "$torchrun" $ranks
            echo "$SECONDS" >"$CI_DIR/killed_at"
            say "killed $1's torchrun and ranks ($torchrun $ranks)"
            return
        fi
        sleep 0.1
    done
    say "$1's ranks never started"
}
kill_node ci-node2 &
PIDS+=($!)
status=0
submit DATA_DIR="$CI_DIR/data" OUT_DIR="$CI_DIR/out-failing" \
    sbatch --wait --nodes=2 --gpus-per-node=0 --time=4 --output="$CI_DIR/failing-%j.out" submit_slurm.sh \
    --collective_timeout_min 0.5 || status=$?
[[ -f $CI_DIR/killed_at ]] || { echo "$CI_NAME: ci-node2 was never killed"; exit 1; }
[[ $(cat "$CI_DIR/fabric_ranks" 2>/dev/null | wc -l) == "$NPROC" ]] ||
    { echo "$CI_NAME: GLOO_SOCKET_IFNAME did not reach the ranks on ci-node2"; exit 1; }
say "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME reached both ranks on ci-node2"
after=$((SECONDS - $(cat "$CI_DIR/killed_at")))
say "failing-node job ended with status $status, $after s after the kill (wall 240 s)"
log=$(ls "$CI_DIR"/failing-*.out)
grep -E '^node .*: torchrun exited' "$log"
[[ $status != 0 && $after -le 60 ]] || { echo "$CI_NAME: the job did not fail fast"; exit 1; }
failed=$(grep -E '^node .*: torchrun exited [1-9]' "$log" || true)
[[ $failed == "node ci-node2: torchrun exited 137" ]] || { echo "$CI_NAME: not one message naming ci-node2"; exit 1; }
for node in "${NODES[@]}"; do
    for pid in $(ip netns pids "$node"); do
        [[ $(cmdline "$pid") != *train.py* ]] || { echo "$CI_NAME: a rank outlived the job on $node"; exit 1; }
    done
done

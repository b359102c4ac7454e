#!/bin/bash
# One lane of the replan benchmark (BENCHMARKS.md, "When the numbers the plan leans on are wrong"): 3 seeds of l4w128
# on the bench corpus with the organizers' flags, a binding --max_steps 40 and a step forecast that is off
# (--auto_efficiency 0.4; EFFICIENCY=1.0 forecasts it too fast, the device slower than planned), pinned to one core.
# BATCH sets the --batch_size floor (8; 2 lets the forced batch split into 6 micro-steps, room for the replan to go down).
#   bash bench/replan_lane.sh CODE OUT CORE      e.g. an old checkout on core 0 and this one on core 1, side by side
set -u
CODE=$1; OUT=$2; CORE=$3; CORPUS=${CORPUS:-/work/bench_corpus}; EFFICIENCY=${EFFICIENCY:-0.4}; BATCH=${BATCH:-8}
for seed in 0 1 2; do
  d=$OUT/seed$seed; mkdir -p "$d"
  OMP_NUM_THREADS=1 taskset -c "$CORE" python "$CODE/train.py" --data_dir "$CORPUS" --n_layer 4 --n_embd 128 \
    --n_head 4 --seq_len 256 --batch_size "$BATCH" --grad_accum_steps 4 --max_steps 40 --time_limit_min 2 \
    --auto_efficiency "$EFFICIENCY" --seed "$seed" --checkpoint_path "$d/ckpt.pt" --metrics_path "$d/metrics.jsonl" \
    >"$d/log.txt" 2>&1
done

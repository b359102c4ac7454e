#!/bin/bash
# One lane of the default-recipe check (BENCHMARKS.md): 3 seeds of a checkout's default recipe at the CPU speedrun
# shape (l4w128, seq 256) with the organizers' flags for 5 minutes on the bench corpus, pinned to one core, each
# checkpoint scored by that checkout's eval.py on the first 32,768 tokens of val.bin.
#   bash bench/recipe_lane.sh CODE OUT CORE     e.g. an old checkout on core 0 and this one on core 1, side by side
#   EXTRA="--normuon_beta2 0" bash bench/recipe_lane.sh . OUT 0    flags added to every run (a recipe item off)
#   SHAPE="--n_layer 8 --n_embd 128 --n_head 4" bash bench/recipe_lane.sh . OUT 0    another shape (default l4w128)
set -u
CODE=$1; OUT=$2; CORE=$3; CORPUS=${CORPUS:-/work/bench_corpus}; MIN=${MIN:-5}
SHAPE=${SHAPE:---n_layer 4 --n_embd 128 --n_head 4}
for seed in 0 1 2; do
  d=$OUT/seed$seed; mkdir -p "$d"
  OMP_NUM_THREADS=1 taskset -c "$CORE" python "$CODE/train.py" --data_dir "$CORPUS" --val_file "$CORPUS/val.bin" \
    $SHAPE --seq_len 256 --batch_size 8 --grad_accum_steps 4 --max_steps 5000 \
    --time_limit_min "$MIN" --val_eval_tokens 16384 --seed "$seed" --checkpoint_path "$d/ckpt.pt" \
    --metrics_path "$d/metrics.jsonl" ${EXTRA:-} >"$d/log.txt" 2>&1
  OMP_NUM_THREADS=1 taskset -c "$CORE" python "$CODE/eval.py" "$d/ckpt.pt" --data "$CORPUS/val.bin" \
    --max_tokens 32768 --device cpu >"$d/eval.txt" 2>&1
done

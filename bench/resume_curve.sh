#!/bin/bash
# A run over several jobs against the same run whole (BENCHMARKS.md, "Runs longer than one job"): the same flags and
# seed on the bench corpus; the whole run on one core, and beside it on the other a chain of jobs, each ended by a fake
# SLURM wall (SLURM_JOB_END_TIME, JOB_S after it starts) with --budget_spans_jobs, as submit_slurm.sh's requeue runs
# them; then plot.py draws both runs' curves.
#   bash bench/resume_curve.sh CORPUS OUT [BUDGET_MIN] [JOB_S]
set -euo pipefail
CORPUS=${1:?usage: resume_curve.sh CORPUS OUT [BUDGET_MIN] [JOB_S]}
OUT=${2:?usage: resume_curve.sh CORPUS OUT [BUDGET_MIN] [JOB_S]}
BUDGET_MIN=${3:-4}
JOB_S=${4:-100}
REPO=$(cd "$(dirname "$0")/.." && pwd)
FLAGS=(--data_dir "$CORPUS" --val_file "$CORPUS/val.bin" --vocab_size 32000 --seq_len 256 --model l4w128
    --time_limit_min "$BUDGET_MIN" --val_every_min 0.5 --val_eval_tokens 16384 --save_state)
mkdir -p "$OUT/whole" "$OUT/jobs"
export OMP_NUM_THREADS=1
taskset -c 0 python3 "$REPO/train.py" "${FLAGS[@]}" --checkpoint_path "$OUT/whole/checkpoint.pt" \
    > "$OUT/whole/log.txt" 2>&1 &
WHOLE=$!
reason=wall
while [[ $reason == wall ]]; do
    SLURM_JOB_END_TIME=$(python3 -c "import time; print(time.time() + $JOB_S)") taskset -c 1 \
        python3 "$REPO/train.py" "${FLAGS[@]}" --budget_spans_jobs --slurm_reserve_s 10 \
        --checkpoint_path "$OUT/jobs/checkpoint.pt" >> "$OUT/jobs/log.txt" 2>&1
    reason=$(python3 -c 'import json, sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["stop_reason"])' \
        "$OUT/jobs/metrics.jsonl")
    echo "job ended: $reason"
done
wait $WHOLE
python3 "$REPO/plot.py" "$OUT/whole/metrics.jsonl" "$OUT/jobs/metrics.jsonl" --out "$OUT/resume_curve.png"
for run in whole jobs; do
    python3 -c 'import json, sys; s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(sys.argv[2], s["steps"], "steps,", round(s["train_s"]), "s, val", round(s["val_loss"], 4), "jobs", [(j["steps"], j["stop_reason"]) for j in s["jobs"]])' \
        "$OUT/$run/metrics.jsonl" "$run"
done

#!/usr/bin/env bash
# The optimizer choices the CPU could not settle, at the event's shape on one GPU: a second device call
# after bench/gpu_check.sh, <= 8 minutes with its start-up. Each variant is one compiled bf16 train.py run of
# l16w1024 with the organizers' flags (--seq_len 1024 --batch_size 8 --grad_accum_steps 4 --max_steps 5000) at
# equal wall clock (TRAIN_MIN each), on the same data, scored by eval.py (model.py alone, the organizers' load) on
# held-out windows that no run trains on. One seed: a difference of a few hundredths is noise; BENCHMARKS.md says
# how the table is read, and that a clear result here overrides the CPU decision.
#   bash bench/gpu_ab.sh [TRAIN_MIN]          TRAIN_MIN: each variant's training budget in minutes, default 1.25
#   DATA=DIR bash bench/gpu_ab.sh             real token files (chunk_*.bin + val.bin, e.g. the bench corpus)
#   VARIANTS="name=flags;name=flags" ...      other variants (default below: the chosen defaults, then the rivals)
#   SMOKE=1 bash bench/gpu_ab.sh 0.2          the same on CPU at 2 layers, tiny: checks the script itself
# $OUT/results.md gets the table; each run's log, metrics and eval output stay in $OUT/<variant>/.
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN_MIN=${1:-1.25}
OUT=${OUT:-runs/gpu_ab}
DEADLINE=$((SECONDS + ${GPU_AB_S:-450}))
mkdir -p "$OUT"
RESULTS=$OUT/results.md
export PYTHONUNBUFFERED=1
ORGANIZERS="--seq_len 1024 --batch_size 8 --grad_accum_steps 4 --max_steps 5000"
# the defaults (BENCHMARKS.md, "Optimizer settings on evidence"), then what the CPU could not settle for the event:
# the 0.4 cooldown (the 0.7 leaned worse on every CPU seed, within the noise; the record chose 0.7) and the Muon LR
# before this change, 0.05 (0.025 won at width 128 on every CPU seed; whether that holds at 1,024 is the question).
# At one GPU the batch is the recipe's, so --lr_rule is not in play here.
VARIANTS=${VARIANTS:-"chosen=;decay_0.4=--decay_frac 0.4;muon_lr_0.05=--muon_lr 0.05"}
if [[ ${SMOKE:-0} == 1 ]]; then
    DEVICE=cpu TOKENS=400000 CHUNK=200000 EVAL_TOKENS=8192
    SHAPE="--n_layer 2 --n_head 2 --n_embd 64 --seq_len 64 --batch_size 2 --batch_tokens 128 --val_eval_tokens 4096"
else
    DEVICE=cuda TOKENS=100000000 CHUNK=50000000 EVAL_TOKENS=1048576
    SHAPE="$ORGANIZERS --n_layer 16 --n_head 8 --n_embd 1024 --compile --val_eval_tokens 262144"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$RESULTS"
fi
echo "# gpu_ab $(date -u +%FT%TZ) on $DEVICE, $TRAIN_MIN min each" >>"$RESULTS"

if [[ -n ${DATA:-} ]]; then
    data=$DATA val=$DATA/val.bin
else  # synthetic 32K-vocab tokens; the last chunk is moved out of the training folder: the held-out windows
    data=$OUT/data val=$OUT/val/chunk_0001.bin
    if [[ ! -f $val ]]; then
        python data_cli.py synth "$data" --tokens "$TOKENS" --chunk_tokens "$CHUNK" --vocab_size 32000 >/dev/null
        mkdir -p "$OUT/val" && mv "$data/chunk_0001.bin" "$val"
    fi
fi

status=0
echo "| variant | flags | steps | tokens | train s | eval val_loss |" >>"$RESULTS"
echo "| --- | --- | --- | --- | --- | --- |" >>"$RESULTS"
IFS=';' read -ra specs <<<"$VARIANTS"
for spec in "${specs[@]}"; do
    name=${spec%%=*} flags=${spec#*=} dir=$OUT/${spec%%=*}
    mkdir -p "$dir"
    left=$((DEADLINE - SECONDS))
    slot=$(awk "BEGIN { print int($TRAIN_MIN * 60 + 120) }")
    ((slot < left)) || slot=$left
    if ((slot <= 30)); then
        echo "| $name | $flags | skipped: the deadline has passed | | | |" | tee -a "$RESULTS"
        status=1
        continue
    fi
    rc=0
    # shellcheck disable=SC2086
    timeout --kill-after=15 "$slot" python train.py --data_dir "$data" --val_file "$val" --device "$DEVICE" \
        $SHAPE --time_limit_min "$TRAIN_MIN" --save_every_min 0 --checkpoint_path "$dir/checkpoint.pt" $flags \
        >"$dir/train.log" 2>&1 || rc=$?
    if ((rc == 0)); then
        python eval.py "$dir/checkpoint.pt" --data "$val" --max_tokens "$EVAL_TOKENS" --device "$DEVICE" \
            >"$dir/eval.log" 2>&1 || rc=$?
    fi
    if ((rc != 0)); then
        echo "| $name | $flags | failed (exit $rc, see $dir) | | | |" | tee -a "$RESULTS"
        status=$rc
        continue
    fi
    python - "$name" "$flags" "$dir" <<'EOF' | tee -a "$RESULTS"
import json, sys
name, flags, folder = sys.argv[1:]
s = json.loads(open(f"{folder}/metrics.jsonl").read().strip().splitlines()[-1])
e = json.loads(open(f"{folder}/eval.log").read().strip().splitlines()[-1])
print(f"| {name} | {flags or '(defaults)'} | {s['steps']} | {s['tokens']:,} | {s['train_s']:.0f} | {e['val_loss']:.4f} |")
EOF
done
echo "gpu_ab: $SECONDS s; the table is in $RESULTS"
exit "$status"

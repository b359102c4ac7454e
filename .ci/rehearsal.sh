#!/usr/bin/env bash
# The scored configuration, rehearsed on CPU: what the organizers run, on what turns on the event's code paths.
# Bundle the submission into a fresh folder; from there, torchrun 2 gloo ranks with the organizers' flag set on
# event-format data (32K vocabulary, no --vocab_size), plus --compile, 16 layers at a tiny width, periodic
# validation and a ragged last validation batch (11 windows per rank in batches of 8). Passes when the job exits 0,
# the summary has a validation loss, the last step ran at the floor LR inside the budget, every graph was compiled
# at step 0 as planned, and eval.py (model.py alone, the organizers' load) scores the same loss on the same windows.
#   bash .ci/rehearsal.sh            REHEARSAL_MIN=1 bash .ci/rehearsal.sh   (the training budget, default 2.5)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/rehearsal.XXXXXX)
BUDGET_MIN=${REHEARSAL_MIN:-2.5}
VAL_TOKENS=$((22 * 1025))   # 2 ranks x 11 windows of seq_len + 1
T0=$SECONDS
trap 'echo "rehearsal: $([[ $? == 0 ]] && echo PASS || echo FAIL) in $((SECONDS - T0)) s (work dir $WORK)"' EXIT
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

python3 "$REPO/data_cli.py" synth "$WORK/data" --tokens 3000000 --chunk_tokens 1000000 --vocab_size 32000
python3 "$REPO/bundle.py" "$WORK/submission"
cp "$REPO/eval.py" "$WORK/submission/"       # eval.py imports model.py alone: here, the submitted one
cd "$WORK/submission"
python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py \
    --data_dir "$WORK/data" --checkpoint_path checkpoint.pt --seq_len 1024 --batch_size 8 --grad_accum_steps 4 \
    --max_steps 5000 --time_limit_min "$BUDGET_MIN" \
    --compile --n_layer 16 --n_head 2 --n_embd 32 --val_every_min 0.25 --val_tokens "$VAL_TOKENS" \
    >"$WORK/train.log" 2>&1 || { tail -n 40 "$WORK/train.log"; exit 1; }
tr '\r' '\n' <"$WORK/train.log" | grep -v "s/s\]" | grep -v '^\s*$' | tail -n 8 | cut -c1-400
python3 eval.py checkpoint.pt --data "$WORK/data" --max_tokens "$VAL_TOKENS" --device cpu >"$WORK/eval.log"
tail -n 2 "$WORK/eval.log" | head -n 1

FLOOR=$(cd "$REPO" && python3 -c "import config; print(config.Hyperparameters().min_lr_frac)")
python3 - "$WORK/submission/metrics.jsonl" "$WORK/eval.log" "$FLOOR" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
floor = float(sys.argv[3])  # --min_lr_frac's default: the LR fraction of the last step
summary, train_rows = rows[-1], [r for r in rows if "lr_frac" in r]
periodic = [r for r in rows[:-2] if "val_loss" in r]
scored = json.loads(open(sys.argv[2]).read().splitlines()[-1])
step_s = (train_rows[-1]["elapsed_s"] - train_rows[1]["elapsed_s"]) / max(train_rows[-1]["step"] - 1, 1)
checks = {
    "2 ranks, exit 0, a summary with a validation loss": summary["world_size"] == 2 and summary["val_loss"] > 0,
    "stopped by the clock, last step at the floor LR": summary["stop_reason"] == "time_limit"
    and summary["final_lr_frac"] == train_rows[-1]["lr_frac"] == floor,
    "inside the budget (+ the step in flight)": summary["train_s"] <= summary["budget_s"] + step_s,
    "every graph compiled at step 0, as planned": summary["compiled_graphs"] == summary["planned_graphs"] > 0
    and summary["compile_fallback"] is None,
    "the final validation scored every batch, the last one ragged": summary["val_batches"] == 2,
    "a periodic validation ran, planned into the budget": len(periodic) >= 1,
    "eval.py scores the summary's loss on the same windows": scored["windows"] == 22
    and abs(scored["val_loss"] - summary["val_loss"]) < 2e-3,
}
print(f"rehearsal: {summary['steps']} steps, {summary['train_s']} s of {summary['budget_s']} s, compile "
      f"{summary['compile_s']} s, {summary['compiled_graphs']} graphs, {len(periodic)} periodic validations, "
      f"val_loss {summary['val_loss']:.4f} (eval.py {scored['val_loss']:.4f})")
for name, ok in checks.items():
    print(f"  {'ok  ' if ok else 'FAIL'} {name}")
sys.exit(0 if all(checks.values()) else 1)
EOF

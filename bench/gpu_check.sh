#!/usr/bin/env bash
# One-call check for a single-GPU machine, under 10 minutes, ending in tables for BENCHMARKS.md:
#   1. the CUDA paths (per-block compiled bf16 model vs eager, the fused head + loss, Muon in bf16, fused AdamW,
#      the pinned loader);
#   2. cold compile time of the whole model vs each block (l12w768, micro-batch 8), then per-block tokens/s, MFU,
#      optimizer time and peak memory at micro-batch 8, 16 and 32 for l12w768 and l16w1024 with train.py's fused
#      head + loss (bench/compile_time.py: a fresh process and an empty compile cache per row);
#   3. a short compiled bf16 train.py run of l12w768 on synthetic 32K-vocab data.
# Each part runs under its own timeout, all inside one deadline, so a failure or a hang keeps the other parts'
# output; the exit status is the first failing part's.
#   bash bench/gpu_check.sh [TRAIN_MIN]       TRAIN_MIN: the training budget in minutes, default 1
#   SMOKE=1 bash bench/gpu_check.sh 0.2       the same steps on CPU at a tiny size: checks the script itself
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN_MIN=${1:-1}
OUT=${OUT:-runs/gpu_check}
DEADLINE=$((SECONDS + ${GPU_CHECK_S:-570}))  # the device tool stops a command at 600 s
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ ${SMOKE:-0} == 1 ]]; then
    DEVICE=cpu COMPARE=l2w64 SHAPES=l2w64 BATCH=1,2 SEQ=32 THREADS=1 TOKENS=2000000
    TRAIN_SHAPE="--model l2w64 --batch_size 2 --seq_len 64"
else
    DEVICE=cuda COMPARE=l12w768 SHAPES=l12w768,l16w1024 BATCH=8,16,32 SEQ=1024 THREADS=8 TOKENS=100000000
    TRAIN_SHAPE="--model l12w768 --batch_size 32 --seq_len 1024"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
status=0

part() {  # part SECONDS NAME COMMAND...: run it under a timeout cut to the deadline; on failure say so and go on
    local seconds=$1 name=$2 rc=0
    shift 2
    seconds=$((seconds < DEADLINE - SECONDS ? seconds : DEADLINE - SECONDS))
    echo "== $name"
    if ((seconds <= 0)); then
        echo "!! $name: skipped, the deadline has passed"
        ((status)) || status=1
        return
    fi
    timeout "$seconds" "$@" || rc=$?
    if ((rc != 0)); then
        echo "!! $name: exit $rc$( ((rc == 124)) && echo ", timed out after ${seconds} s")"
        ((status)) || status=$rc
    fi
}

part 120 "CUDA paths: per-block compiled bf16 model vs eager, fused head, Muon in bf16, the loader" \
    python - "$DEVICE" <<'EOF'
import math, sys, torch
from model import get_model
from muon import build_optimizers, zeropower_via_newtonschulz
from data import BatchLoader, synthetic_tokens
dev = torch.device(sys.argv[1])
amp = torch.autocast(dev.type, dtype=torch.bfloat16)
m = get_model({"vocab_size": 32000, "n_layer": 4, "n_embd": 256, "n_head": 4, "zero_init_proj": False}).to(dev)
idx = torch.randint(0, 32000, (4, 256), device=dev)
for T in (1, 7, 4096):  # eager, before compiling: every length is one more graph for dynamic=False blocks
    assert m(idx[:, :1].repeat(1, T))[0].shape == (4, T, 32000)
with amp:
    _, loss_e = m(idx, idx)
m.compile_per_block()
with amp:
    _, loss_c = m(idx, idx)
    _, loss_f = m(idx, idx, return_logits=False)  # train.py's chunked head + loss
assert abs(loss_e.item() - loss_c.item()) < 0.05, (loss_e.item(), loss_c.item())
assert abs(loss_f.item() - loss_c.item()) < 0.05, (loss_f.item(), loss_c.item())
assert abs(loss_e.item() - math.log(32000)) < 1.0
assert not any("_orig_mod" in k for k in m.state_dict())
s = torch.linalg.svdvals(zeropower_via_newtonschulz(torch.randn(8, 768, 3072, device=dev)).float())
assert 0.5 < s.min() and s.max() < 1.3, (s.min().item(), s.max().item())
opts = build_optimizers(m, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
assert opts[1].defaults.get("fused") or dev.type != "cuda", "AdamW should be fused on CUDA"
loader = BatchLoader([synthetic_tokens(1 << 20)], 256, 8, 0, 1, device=dev)
x, y = next(loader)
assert x.device.type == dev.type and torch.equal(x[:, 1:], y[:, :-1])
loader.close()
print(f"{dev.type} checks passed")
EOF

part 200 "cold compile: whole model vs per block, $COMPARE" \
    python bench/compile_time.py --device "$DEVICE" --shapes "$COMPARE" --batch "${BATCH%%,*}" --seq "$SEQ" \
    --threads "$THREADS" --timeout 150
part 300 "per-block steps by micro-batch, train.py's fused head + loss: $SHAPES" \
    python bench/compile_time.py --device "$DEVICE" --modes per_block --shapes "$SHAPES" --batch "$BATCH" \
    --seq "$SEQ" --head fused --optimizer --steps 5 --threads "$THREADS" --timeout 100

part 60 "synthetic data" python data.py synth "$OUT/data" --tokens "$TOKENS"
# the whole log goes to a file; the console gets its last lines without the progress bar
# shellcheck disable=SC2086
part "$(awk "BEGIN { print int($TRAIN_MIN * 60 + 150) }")" "${TRAIN_MIN}-minute train.py run: $TRAIN_SHAPE on $DEVICE" \
    bash -c 'python train.py "${@:2}" >"$1/train.log" 2>&1; rc=$?; grep -v "|" "$1/train.log" | tail -n 6; exit $rc' \
    _ "$OUT" --data_dir "$OUT/data" --vocab_size 32000 $TRAIN_SHAPE --device "$DEVICE" --time_limit_min "$TRAIN_MIN" \
    --checkpoint_path "$OUT/checkpoint.pt"
part 30 "train.py run summary" python - "$OUT/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
s = rows[-1]
steady = [r for r in rows if "tokens_per_s" in r and "train_loss" in r][1:]  # the first row carries compilation
steady = steady[len(steady) // 2:]
tok = sum(r["tokens_per_s"] for r in steady) / len(steady)
mfu = sum(r.get("mfu", 0.0) for r in steady) / len(steady)
print("| compile s | tokens/s (steady) | MFU (bf16 peak) | peak mem GiB | steps | final train loss | val loss |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print(f"| {s['compile_s']:.1f} | {tok:,.0f} | {mfu:.1%} | {s['peak_mem_gib']} | {s['steps']} | "
      f"{[r for r in rows if 'train_loss' in r][-1]['train_loss']:.3f} | {s['val_loss']:.3f} |")
plan = s["plan"]  # the run plan's forecast next to what the device did (issue: calibrate AUTO_EFFICIENCY["cuda"])
step_ms = 1e3 * s["tokens"] / s["steps"] / tok if s["steps"] else float("nan")
print("| plan tokens/step | micro x accum | forecast ms/step | measured ms/step (steady) | measured / forecast |")
print("| --- | --- | --- | --- | --- |")
print(f"| {plan['tokens_per_step']:,} | {plan['micro_batch']} x {s['grad_accum_steps']} | {1e3 * plan['step_s']:.1f} | "
      f"{step_ms:.1f} | {step_ms / (1e3 * plan['step_s']):.2f} |")
EOF
exit "$status"

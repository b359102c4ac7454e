#!/usr/bin/env bash
# One-call check for a single-GPU machine, ending in tables for BENCHMARKS.md, in the order of what matters most:
#   1. the CUDA paths (per-block compiled bf16 model vs eager, the fused head + loss, Muon in bf16, fused AdamW,
#      the pinned loader); each SDPA backend's forward + backward time and agreement with math at the event's head
#      shape, and the backend a run here chooses (bench/attention_backends.py);
#   2. the event shape end to end: a compiled bf16 train.py run of l16w1024 at the plan's micro-batch on synthetic
#      32K-vocab data, with periodic and final validation, and its summary (the versions line and attention backend,
#      pre-clock seconds, compile time, graphs, ranks that fell back to eager, tokens/s, MFU, the plan's forecast
#      against the measured step); its --profile of steps 3-5: host time per step against GPU busy time, and the
#      attention op each compiled graph calls (bench/profile_summary.py); then both head-loss forms
#      (bench/head_loss.py);
#   3. per-block tokens/s, MFU, optimizer time and peak memory at micro-batch 8, 16 and 32 for l12w768 and
#      l16w1024 with train.py's fused head + loss (bench/compile_time.py: a fresh process and an empty compile
#      cache per row), then the cold compile time of the whole model against each block.
# Each part runs under its own timeout, cut to one deadline (default 360 s: the device lends 15 minutes a session,
# so a rerun still fits); a failure or a hang keeps the other parts' output. Each part's output is appended to
# $OUT/results.md as it finishes. The exit status is the first failing part's.
#   bash bench/gpu_check.sh [TRAIN_MIN]       TRAIN_MIN: the training budget in minutes, default 1
#   SMOKE=1 bash bench/gpu_check.sh 0.3       the same parts on CPU at 8 layers, tiny: checks the script itself
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN_MIN=${1:-1}
OUT=${OUT:-runs/gpu_check}
DEADLINE=$((SECONDS + ${GPU_CHECK_S:-360}))
mkdir -p "$OUT"
RESULTS=$OUT/results.md
export PYTHONUNBUFFERED=1
if [[ ${SMOKE:-0} == 1 ]]; then
    DEVICE=cpu COMPARE=l8w64 SHAPES=l8w64 BATCH=1 SEQ=32 THREADS=1 TOKENS=2000000 PATHS="8 64 64 256"
    MODES=per_block  # compiling the whole model takes minutes on CPU
    TRAIN_SHAPE="--n_layer 8 --n_head 2 --n_embd 64 --batch_size 2 --seq_len 64 --val_eval_tokens 4160"
    ATTENTION="--batch 1 --heads 2 --seq 64 --head_dim 32 --reps 3"
    HEAD_LOSS=--help  # its CPU bench takes minutes on a shared 2-core box: the smoke checks that it starts
    PROFILE=--missing_ok  # a compile on a loaded box can leave the short run no steps 3-5 to profile
else
    DEVICE=cuda COMPARE=l12w768 SHAPES=l12w768,l16w1024 BATCH=8,16,32 SEQ=1024 THREADS=8 TOKENS=100000000
    MODES=whole,per_block
    PATHS="4 256 4096 3072"  # layers, width, the longest eager length, Newton-Schulz columns
    TRAIN_SHAPE="--model l16w1024 --batch_size 8 --seq_len 1024 --batch_tokens 131072"  # more steps in a minute
    ATTENTION="--batch 13 --heads 8 --seq 1024 --head_dim 128"  # the event's micro-batch and heads
    HEAD_LOSS="--parts forms --device cuda --rounds 3"  # the event's chunk, both forms, 1 and 3 targets
    PROFILE=""
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$RESULTS"
fi
echo "# gpu_check $(date -u +%FT%TZ) on $DEVICE" >>"$RESULTS"
status=0

part() {  # part SECONDS NAME COMMAND...: run it under a timeout cut to the deadline; on failure say so and go on
    local seconds=$1 name=$2 rc=0
    shift 2
    seconds=$((seconds < DEADLINE - SECONDS ? seconds : DEADLINE - SECONDS))
    echo "== $name" | tee -a "$RESULTS"
    if ((seconds <= 0)); then
        echo "!! $name: skipped, the deadline has passed" | tee -a "$RESULTS"
        ((status)) || status=1
        return
    fi
    # SIGTERM first (train.py then saves and validates), SIGKILL 15 s later: no part outlives its slot
    timeout --kill-after=15 "$seconds" "$@" 2>&1 | tee -a "$RESULTS" || rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        echo "!! $name: exit $rc$( ((rc == 124)) && echo ", timed out after ${seconds} s")" | tee -a "$RESULTS"
        ((status)) || status=$rc
    fi
}

part 90 "CUDA paths: per-block compiled bf16 model vs eager, fused head, Muon in bf16, the loader" \
    python - "$DEVICE" $PATHS <<'EOF'
import math, sys, torch
from model import get_model
from headloss import compiled_head_loss
from muon import zeropower_via_newtonschulz
from optimizers import build_optimizers
from data import BatchLoader
from shards import Deal
from synthetic import synthetic_tokens
from windows import WindowSpec
dev = torch.device(sys.argv[1])
layers, width, longest, ns_cols = map(int, sys.argv[2:])
amp = torch.autocast(dev.type, dtype=torch.bfloat16)
m = get_model({"vocab_size": 32000, "n_layer": layers, "n_embd": width, "n_head": 4, "zero_init_proj": False})
m = m.to(dev)
idx = torch.randint(0, 32000, (4, 256), device=dev)
for T in (1, 7, longest):  # eager, before compiling: every length is one more graph for dynamic=False blocks
    assert m(idx[:, :1].repeat(1, T))[0].shape == (4, T, 32000)
with amp:
    _, loss_e = m(idx, idx)
m.compile_per_block()
with amp:
    _, loss_c = m(idx, idx)
    _, loss_f = m(idx, idx, loss_fn=compiled_head_loss())  # train.py's chunked head + loss
assert abs(loss_e.item() - loss_c.item()) < 0.05, (loss_e.item(), loss_c.item())
assert abs(loss_f.item() - loss_c.item()) < 0.05, (loss_f.item(), loss_c.item())
assert abs(loss_e.item() - math.log(32000)) < 1.0
assert not any("_orig_mod" in k for k in m.state_dict())
s = torch.linalg.svdvals(zeropower_via_newtonschulz(torch.randn(8, ns_cols // 4, ns_cols, device=dev)).float())
assert 0.5 < s.min() and s.max() < 1.3, (s.min().item(), s.max().item())
opts = build_optimizers(m, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
assert opts[1].defaults.get("fused") or dev.type != "cuda", "AdamW should be fused on CUDA"
loader = BatchLoader([synthetic_tokens(1 << 20)], WindowSpec(256), 8, Deal(0, 1), device=dev)
x, y = next(loader)
assert x.device.type == dev.type and torch.equal(x[:, 1:], y[:, :-1])
loader.close()
print(f"{dev.type} checks passed")
EOF

# shellcheck disable=SC2086
part 40 "SDPA backends at the event's head shape, and the run's choice" \
    python bench/attention_backends.py --device "$DEVICE" $ATTENTION

# a rerun on the same machine keeps the data a finished synth left (device seconds); a partial one is written anew
if [[ -f $OUT/data.done ]]; then
    echo "== synthetic data: kept from an earlier run ($OUT/data)" | tee -a "$RESULTS"
else
    rm -rf "$OUT/data"
    part 30 "synthetic data" bash -c 'python data_cli.py synth "$1" --tokens "$2" --vocab_size 32000 && touch "$1.done"' \
        _ "$OUT/data" "$TOKENS"
fi
# the whole log goes to a file; the console and results get its last lines without the progress bar
# shellcheck disable=SC2086
part "$(awk "BEGIN { print int($TRAIN_MIN * 60 + 90) }")" "${TRAIN_MIN}-minute compiled train.py run: $TRAIN_SHAPE" \
    bash -c 'python train.py "${@:2}" >"$1/train.log" 2>&1; rc=$?; tr "\r" "\n" <"$1/train.log" |
        grep -v "s/s\]" | tail -n 6; exit $rc' \
    _ "$OUT" --data_dir "$OUT/data" $TRAIN_SHAPE --compile --device "$DEVICE" --time_limit_min "$TRAIN_MIN" \
    --val_every_min "$(awk "BEGIN { print $TRAIN_MIN / 4 }")" --checkpoint_path "$OUT/checkpoint.pt" \
    --on_recompile fail --profile
part 20 "train.py run summary" python - "$OUT/metrics.jsonl" "$OUT/train.log" <<'EOF'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
log = open(sys.argv[2], errors="replace").read().replace("\r", "\n").splitlines() if os.path.exists(sys.argv[2]) else []
for line in log:  # the versions line (torch, Triton, CUDA, cuDNN, NCCL, the GPU, the attention backend), kernel notes
    if line.startswith(("torch ", "toolchain:", "attention:", "compile:", "warning: Triton", "warning: compiling failed",
                        "warning: step 0 failed")):
        print(line)
profiled = [i for i, line in enumerate(log) if line.startswith("profile: steps")]
for line in log[profiled[0]:profiled[0] + 22] if profiled else ["profile: no window (the run ended before step 6)"]:
    print(line)  # --profile's line and its top ops by self time
train = [r for r in rows if "tokens_per_s" in r and "train_loss" in r]
s = rows[-1] if rows and rows[-1].get("summary") else None
if s is None:  # the run died before its summary: say how far it got, then fail this part
    print(f"no summary row: the run ended early; its last training row: {json.dumps(train[-1] if train else None)}")
    sys.exit(1)
steady = train[1:][len(train[1:]) // 2:]  # the first row carries compilation
tok = sum(r["tokens_per_s"] for r in steady) / max(len(steady), 1)
mfu = sum(r.get("mfu", 0.0) for r in steady) / max(len(steady), 1)
startup = s.get("startup_s")  # the pre-clock seconds, where the summary has them
print("| attention | start-up s | compile s | graphs (planned) | eager ranks | eager runs | rollbacks | "
      "tokens/s (steady) | MFU (bf16 peak) | peak mem GiB | steps | train loss | val loss |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
print(f"| {s.get('attention')}, op {s.get('attention_op')} | {'n/a' if startup is None else f'{startup:.1f}'} | "
      f"{s['compile_s']:.1f} | "
      f"{s['compiled_graphs']} ({s['planned_graphs']}) | {s.get('compile_fallback_ranks') or 'none'} | "
      f"{s['eager_runs']} | {len(s['rollbacks'])} | {tok:,.0f} | {mfu:.1%} | {s['peak_mem_gib']} | {s['steps']} | "
      f"{train[-1]['train_loss']:.3f} | {s['val_loss']:.3f} |")
plan = s["plan"]  # the plan's forecast next to what the device did: calibrates AUTO_EFFICIENCY["cuda"]
step_ms = 1e3 * plan["micro_batch"] * plan["seq_len"] * s["grad_accum_steps"] * s["world_size"] / tok if tok else 0.0
print("| plan tokens/step | micro x accum | forecast ms/step | measured ms/step (steady) | measured / forecast |")
print("| --- | --- | --- | --- | --- |")
print(f"| {plan['tokens_per_step']:,} | {plan['micro_batch']} x {s['grad_accum_steps']} | {1e3 * plan['step_s']:.1f} | "
      f"{step_ms:.1f} | {step_ms / (1e3 * plan['step_s']):.2f} |")
EOF
# shellcheck disable=SC2086
part 20 "profile of steps 3-5: host time per step against GPU busy time; the attention op each compiled graph calls" \
    python bench/profile_summary.py "$OUT/metrics.trace.json" $PROFILE
# the head's loss, both forms (bench/head_loss.py)
# shellcheck disable=SC2086
part 60 "head + loss: the in-place and functional chunk loss at the event's chunk" python bench/head_loss.py $HEAD_LOSS
part 150 "per-block steps by micro-batch, train.py's fused head + loss: $SHAPES" \
    python bench/compile_time.py --device "$DEVICE" --modes per_block --shapes "$SHAPES" --batch "$BATCH" \
    --seq "$SEQ" --head fused --optimizer --steps 5 --threads "$THREADS" --timeout 70
part 100 "cold compile: whole model vs per block, $COMPARE" \
    python bench/compile_time.py --device "$DEVICE" --modes "$MODES" --shapes "$COMPARE" --batch "${BATCH%%,*}" --seq "$SEQ" \
    --threads "$THREADS" --timeout 80
echo "gpu_check: $SECONDS s; the tables are in $RESULTS"
exit "$status"

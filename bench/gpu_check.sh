#!/usr/bin/env bash
# One-call check for a single-GPU machine, under 8 minutes: the CUDA paths, then a short compiled bf16
# training run at the default shape on synthetic data, ending in a table for BENCHMARKS.md.
#   bash bench/gpu_check.sh [TRAIN_MIN]          (TRAIN_MIN: the training budget, default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN_MIN=${1:-3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

echo "== CUDA paths: compiled bf16 model vs eager, Muon in bf16, the pinned loader"
python - <<'EOF'
import math, time, numpy as np, torch
from model import get_model
from muon import build_optimizers, zeropower_via_newtonschulz
from data import BatchLoader, synthetic_tokens
dev = torch.device("cuda")
m = get_model({"vocab_size": 32000, "n_layer": 4, "n_embd": 256, "n_head": 4, "zero_init_proj": False}).to(dev)
idx = torch.randint(0, 32000, (4, 256), device=dev)
with torch.autocast("cuda", dtype=torch.bfloat16):
    eager, loss_e = m(idx, idx)
    compiled, loss_c = torch.compile(m)(idx, idx)
assert abs(loss_e.item() - loss_c.item()) < 0.05, (loss_e.item(), loss_c.item())
assert abs(loss_e.item() - math.log(32000)) < 1.0
for T in (1, 7, 4096):
    assert m(idx[:, :1].repeat(1, T))[0].shape == (4, T, 32000)
s = torch.linalg.svdvals(zeropower_via_newtonschulz(torch.randn(8, 768, 3072, device=dev)).float())
assert 0.5 < s.min() and s.max() < 1.3, (s.min().item(), s.max().item())
opts = build_optimizers(m, muon_lr=0.05, embed_lr=0.6, head_lr=0.008, scalar_lr=0.04)
assert opts[1].defaults.get("fused"), "AdamW should be fused on CUDA"
tokens = synthetic_tokens(1 << 20)
loader = BatchLoader([tokens], 256, 8, 0, 1, device=dev)
x, y = next(loader)
assert x.is_cuda and torch.equal(x[:, 1:], y[:, :-1])
loader.close()
print("CUDA checks passed")
EOF

echo "== ${TRAIN_MIN}-minute run: l12w768 (the 124M-class shape), torch.compile + bf16, synthetic 32K-vocab data"
python data.py synth "$OUT/data" --tokens 200000000 >/dev/null
python train.py --data_dir "$OUT/data" --vocab_size 32000 --model l12w768 --batch_size 32 --seq_len 1024 \
    --time_limit_min "$TRAIN_MIN" --checkpoint_path "$OUT/checkpoint.pt" 2>&1 | grep -v '|' | tail -n 4
python - "$OUT/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
s = rows[-1]
steady = [r for r in rows if "mfu" in r][len([r for r in rows if "mfu" in r]) // 2:]
mfu = sum(r["mfu"] for r in steady) / len(steady)
tok = sum(r["tokens_per_s"] for r in steady) / len(steady)
print(f"| compile s | tokens/s (steady) | MFU (bf16 peak) | peak mem GiB | steps | final train loss | val loss |")
print(f"| {s['compile_s']:.1f} | {tok:,.0f} | {mfu:.1%} | {s['peak_mem_gib']} | {s['steps']} | "
      f"{[r for r in rows if 'train_loss' in r][-1]['train_loss']:.3f} | {s['val_loss']:.3f} |")
EOF

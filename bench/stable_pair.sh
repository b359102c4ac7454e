#!/bin/bash
# One pair of the rollback-overhead benchmark (BENCHMARKS.md): an old checkout (OLD, e.g. commit 123bdc7, before the
# rollback guard) and this one (NEW) side by side for 75 s on the bench corpus, with the same model (the record's
# switches off) and optimizer math (quintic Newton-Schulz, no weight decay), each pinned to one core; pair i swaps the cores
# when i is odd.
#   for i in 0 1 2; do OLD=/tmp/oldmain NEW=. bash bench/stable_pair.sh $i; done
set -u
i=$1; oc=$((i % 2)); nc=$(((i + 1) % 2))
A="--data_dir ${CORPUS:-/work/bench_corpus} --n_layer 4 --n_embd 128 --n_head 4 --seq_len 256 --batch_size 8 --time_limit_min 1.25 --seed $i --save_every_min 0"
mkdir -p old$i new$i
OMP_NUM_THREADS=1 taskset -c $oc python "$OLD/train.py" $A --checkpoint_path old$i/ck.pt --metrics_path old$i/m.jsonl > old$i/log 2>&1 &
OMP_NUM_THREADS=1 taskset -c $nc python "$NEW/train.py" $A --ns_coeffs quintic --muon_weight_decay 0 --adam_weight_decay 0 --bigram_mult 0 --no-ve_gate --no-backout --checkpoint_path new$i/ck.pt --metrics_path new$i/m.jsonl > new$i/log 2>&1 &
wait

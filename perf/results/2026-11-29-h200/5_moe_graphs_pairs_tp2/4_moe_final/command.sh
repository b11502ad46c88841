#!/usr/bin/env bash
# Session 7, fourth call (two GPUs), this tree (MoE-LoRA form chosen by default: pairs up to 2048 pairs):
#   GPU 1: the row in one run: Qwen3-30B-A3B, batch 64, 8 adapters: no LoRA, fused (eager and replayed), unfused
#   GPU 0: the whole grid (batch 1/16/64/256 x 1/8/32 adapters), unfused up to batch 16
set -u
OUT=${1:-/tmp/trial4}; W=/tmp/trial4; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
CUDA_VISIBLE_DEVICES=1 timeout 230 python3 -m perf.bench_moe_step --batches 64 --adapters 8 --unfused-max-batch 64 \
  --graphs > "$W/moe_b64.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m perf.bench_moe_step --batches 1 16 64 256 --adapters 1 8 32 \
  --unfused-max-batch 16 --graphs > "$W/moe_grid.txt" 2>&1
wait
{ for f in b64 grid; do echo "== $f"; grep -E "^NVIDIA|^ +[0-9]+ +[0-9]+ \||graphs \||wall" "$W/moe_$f.txt"; done; } > "$OUT/trial4.txt"
tar czf "$OUT/trial4.tgz" -C /tmp trial4 2>/dev/null
cat "$OUT/trial4.txt"

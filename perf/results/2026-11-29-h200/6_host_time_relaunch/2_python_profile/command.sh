#!/usr/bin/env bash
# Session 8, second call (two GPUs): the engine thread's host time by Python function (cProfile over every step),
#   GPU 0: n=100 (after a base-only run); GPU 1: n=2000 with 8 loader processes. This tree + profile_engine --python-profile.
set -u
OUT=${1:-/tmp/s8q}; W=/tmp/s8q; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
COMMON="--shape llama3-8b --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4 --python-profile"
(CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -m perf.profile_engine $COMMON --adapters 2000 \
   --adapter-load-processes 8 --out "$W/q2000" > "$W/q2000.txt" 2>&1; echo "q2000 rc=$?" >> "$W/times.txt") &
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m perf.profile_engine $COMMON --adapters 0 100 \
   --out "$W/q100" > "$W/q100.txt" 2>&1; echo "q100 rc=$?" >> "$W/times.txt"
wait
for r in q100 q2000; do cp "$W/$r/python_profile.txt" "$OUT/python_profile_$r.txt" 2>/dev/null
  grep -E "^==|phase|graph:|eager:" "$W/$r.txt" > "$OUT/$r.txt"; done
tar czf "$OUT/s8q.tgz" -C /tmp s8q 2>/dev/null
cat "$W/times.txt" "$OUT"/q*.txt

#!/usr/bin/env bash
# Session 8, first call (two GPUs): where an S-LoRA run's time goes on this tree (ab2cbea), per step kind.
#   GPU 0: profile_engine base-only, n=5, n=100, n=2000 with the default loader processes (4), torch.profiler
#          traces of 3 eager steps of the n=2000 run
#   GPU 1: profile_engine n=5, n=2000 with 12 loader processes (the many-adapter runs wait on loads?)
set -u
OUT=${1:-/tmp/s8p}; W=/tmp/s8p; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
COMMON="--shape llama3-8b --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4"
(CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m perf.profile_engine $COMMON --adapters 5 2000 \
   --adapter-load-processes 12 --out "$W/p12" > "$W/p12.txt" 2>&1; stamp p12 $?) &
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 -m perf.profile_engine $COMMON --adapters 0 5 100 2000 \
   --trace-steps 3 --out "$W/p4" > "$W/p4.txt" 2>&1; stamp p4 $?
wait
{ cat "$W/times.txt"
  for r in p4 p12; do echo "#### $r"; grep -vE "^\s*$|UserWarning|_warn_once|External init" "$W/$r.txt" | tail -n 60; done
} > "$OUT/s8p.txt" 2>&1
cp "$W/p4/trace.txt" "$OUT/trace.txt" 2>/dev/null
tar czf "$OUT/s8p.tgz" -C /tmp s8p 2>/dev/null
cat "$OUT/s8p.txt"

#!/usr/bin/env bash
# Session 8, seventh call (two GPUs, the last ~5 minutes of device time): this tree, profile_engine base-only + n=100,
#   GPU 0: default (prefill attention through torch sdpa, Triton relaunch on), then MANYLORA_TRITON_RELAUNCH=0
#   GPU 1: --prefill-attention paged (prefill rows in the paged-attention kernel; not timed on the H200 before)
set -u
OUT=${1:-/tmp/s8t}; W=/tmp/s8t; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
COMMON="--shape llama3-8b --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4 --adapters 0 100"
prof() { CUDA_VISIBLE_DEVICES=$1 timeout $2 python3 -m perf.profile_engine $COMMON ${4:-} --out "$W/$3" > "$W/$3.txt" 2>&1
         echo "$3 rc=$? at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
prof 1 150 paged "--prefill-attention paged" &
prof 0 130 sdpa
[ $(( $(date +%s) - T0 )) -lt 115 ] && MANYLORA_TRITON_RELAUNCH=0 prof 0 125 no_relaunch
wait
{ cat "$W/times.txt"; for r in sdpa paged no_relaunch; do echo "== $r"; grep -E "^==|graph:|eager:" "$W/$r.txt" 2>/dev/null; done
} > "$OUT/s8t.txt" 2>&1
cat "$OUT/s8t.txt"

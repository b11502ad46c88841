#!/usr/bin/env bash
# What the third session of 2026-11-29 built and could not run on the H200 (no device time was
# left), in one device call of under 10 minutes; run from the repository root with .gpu carried:
#   bash perf/h200/unmeasured.sh $OUT
# 1. the server on CUDA (loader processes are now spawned inside the Triton stub there)   ~1 min
# 2. compiled engine tests: kernel path == PEFT, graphs == eager (grouped prefill attention) ~1 min
# 3. prefill attention, each sequence alone vs grouped, CUDA                                  ~0.5 min
# 4. engine profile, Llama-3-8B shape, n = 0/100/1000: loader processes (default) vs threads  ~2 x 2.5 min
# Prints a short table last; logs under $OUT.
set -u
OUT=${1:-/tmp/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
(bash perf/h200/serve_check.sh "$OUT/serve" > "$OUT/serve_check.txt" 2>&1)
export PYTHONPATH=$PWD
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q tests/kernels/test_engine_kernels.py tests/test_prefill_attention.py \
  -p no:cacheprovider > "$OUT/gpu_engine_tests.txt" 2>&1
timeout 60 python3 -m perf.bench_prefill_attention --device cuda --seqs 1 4 8 16 --chunk 16 64 \
  > "$OUT/bench_prefill_attention.txt" 2>&1
for processes in 4 0; do
  trace=0; [ $processes = 4 ] && trace=3  # torch.profiler tables of 3 eager steps at n = 1000
  timeout 170 python3 -m perf.profile_engine --shape llama3-8b --adapters 0 100 1000 --rate 24 --duration 12 \
    --drain 12 --admit-every-steps 4 --adapter-load-processes $processes --out "$OUT/profile_p$processes" \
    --trace-steps $trace --trace-min-adapters 16 > "$OUT/profile_processes_$processes.txt" 2>&1
done
cp "$OUT/profile_p4/trace.txt" "$OUT/trace_eager_steps.txt" 2>/dev/null
echo "== server check"; grep -A2 "ready after\|refused alone" "$OUT/serve_check.txt" 2>/dev/null | head -12
echo "== GPU tests"; tail -1 "$OUT/gpu_engine_tests.txt"
echo "== prefill attention"; tail -9 "$OUT/bench_prefill_attention.txt"
for processes in 4 0; do
  echo "== engine profile, adapter_load_processes=$processes"; grep "^== " "$OUT/profile_processes_$processes.txt"
done

#!/usr/bin/env bash
# One device call (< 10 min), from the repository root with .gpu carried:
#   BASELINE_REV=<commit> SATURATION=<req/s> bash perf/h200/prefill_kernels_and_server.sh $OUT
# 1. compiled GPU tests: engine kernel path == PEFT, graphs == eager, prefill attention, LoRA kernels   ~2 min
# 2. segmented (prefill) LoRA kernels at prefill sizes: BASELINE_REV's kernels/ and this tree's, in the
#    same run, against the base GEMM, plus a block-config sweep of this tree's                           ~2 min
# 3. the Triton server on the Llama-3-8B shape with 100 adapters: TTFT/ITL at 50% and 90% of SATURATION,
#    then perf_analyzer (generator and llm, gRPC streaming) against the same server                      ~4 min
set -u
OUT=${1:-/tmp/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TRITON_INTERPRET=0 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
  tests/test_prefill_attention.py tests/kernels/test_lora_kernels.py > "$OUT/gpu_tests.txt" 2>&1
mkdir -p /tmp/baseline/kernels
for f in $(git ls-tree --name-only "${BASELINE_REV:?set BASELINE_REV}" kernels/); do git show "$BASELINE_REV:$f" > "/tmp/baseline/$f"; done
PYTHONPATH=/tmp/baseline:$PWD timeout 100 python3 perf/bench_sgmv_prefill.py --out "$OUT/sgmv_baseline.json" \
  > "$OUT/sgmv_baseline.txt" 2>&1
timeout 170 python3 perf/bench_sgmv_prefill.py --sweep --out "$OUT/sgmv.json" > "$OUT/sgmv.txt" 2>&1
python3 perf/bench_sgmv_prefill.py --compare "$OUT/sgmv_baseline.json" "$OUT/sgmv.json" > "$OUT/sgmv_compare.md" 2>&1
PERF_ANALYZER=1 DURATION=${DURATION:-20} timeout 250 bash perf/h200/server_latency.sh "$OUT/server" \
  > "$OUT/server_latency.txt" 2>&1
echo "== GPU tests"; tail -1 "$OUT/gpu_tests.txt"
echo "== prefill LoRA kernels, baseline $BASELINE_REV vs this tree"; cat "$OUT/sgmv_compare.md"
grep -A3 "^== sweep" "$OUT/sgmv.txt"
echo "== server"; grep -E "ready after|\|" "$OUT/server_latency.txt" | head -12
echo "== perf_analyzer"; grep -E "^== |Throughput|latency|failed" "$OUT/server/perf_analyzer.txt" 2>/dev/null | head -24

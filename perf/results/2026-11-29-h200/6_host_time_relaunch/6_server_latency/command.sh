#!/usr/bin/env bash
# Session 8, sixth call (.gpu carried): TTFT/ITL through tritonserver (gRPC streaming, generator model, 100 rank-16
# adapters, S-LoRA workload) at 50% and 90% of 14 req/s (this tree's in-process n=100 headline: 13.6-14.4 req/s),
# then perf_analyzer (--async --streaming) on generator and llm at concurrency 16 and at 4 req/s, 8 s windows.
set -u
OUT=${1:-/tmp/s8s}
EXTRA_PARAMS= PERF_ANALYZER=1 SATURATION=14 DURATION=10 PA_MEASURE_MS=8000 timeout 450 \
  bash perf/h200/server_latency.sh "$OUT" > "$OUT/server_latency.txt" 2>&1
echo "rc=$?" >> "$OUT/server_latency.txt"
rm -f "$OUT"/trace_*.jsonl
grep -E "^\||ready|rc=" "$OUT/server_latency.txt" | tail -n 12
grep -E "Throughput|p50|p99|Request|rate|Concurrency|Failed|did not" "$OUT/perf_analyzer.txt" 2>/dev/null | tail -n 30

#!/usr/bin/env bash
# What is still unmeasured on the H200 after the fourth session of 2026-11-29, in three device calls of
# under 10 minutes each; run from the repository root with .gpu carried:
#   bash perf/h200/unmeasured.sh server $OUT   # compiled GPU tests; the server latency sweep at 50/90% of
#                                              # SATURATION (default 12 req/s) with perf_analyzer     ~6 min
#   bash perf/h200/unmeasured.sh peft $OUT     # engine n=100 vs PEFT mixed and one-at-a-time, 60 s PEFT
#                                              # runs (the 30x ratio; PEFT loads ~94 adapters in ~225 s) ~8 min
#   bash perf/h200/unmeasured.sh steps $OUT    # whole-model decode step with the elementwise fusions on and
#                                              # off, the MoE step (no LoRA / fused / unfused), the
#                                              # segmented kernels, an engine profile with a trace       ~9 min
# A device call returns only a handful of files: each part writes one log and one .tgz of the rest, and
# prints a short table last.
set -u
PART=${1:?part: server, peft or steps}
OUT=${2:-/tmp/h200}
mkdir -p "$OUT"
WORK=/tmp/unmeasured_$PART
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case "$PART" in
server)
  # one pytest call per directory: collected together on the H200 image, test_lora_kernels.py
  # did not see its conftest's `device` fixture
  TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
    > "$WORK/gpu_tests_engine.txt" 2>&1
  TRITON_INTERPRET=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py \
    > "$WORK/gpu_tests_prefill_attention.txt" 2>&1
  PERF_ANALYZER=1 SATURATION=${SATURATION:-12} DURATION=${DURATION:-15} timeout 330 \
    bash perf/h200/server_latency.sh "$WORK/server" > "$WORK/server_latency.txt" 2>&1
  {
    echo "== GPU tests"; tail -n 1 "$WORK"/gpu_tests_*.txt
    echo "== server"; grep -E "ready after|saturation \|" "$WORK/server_latency.txt" | sort -u
    echo "== stub crash, if any"; grep -B2 -A30 "Fatal Python error" "$WORK/server/server.log" | head -60
    echo "== stub threads at the end (SIGUSR1)"; grep -A12 "^Thread 0x\|^Current thread" "$WORK/server/server.log" | head -80
    echo "== perf_analyzer"; grep -E "^== |Throughput|latency|failed" "$WORK/server/perf_analyzer.txt" | head -30
  } > "$OUT/server.txt" 2>&1
  ;;
peft)
  timeout 560 python3 -m perf.headline --shape llama3-8b --out "$WORK/headline" --adapters 100 --rate 24 \
    --duration 12 --drain 15 --peft-duration ${PEFT_DURATION:-60} --max-num-seqs 128 --admit-every-steps 4 \
    > "$WORK/headline.txt" 2>&1
  tr '\r' '\n' < "$WORK/headline.txt" | grep -v "req/s\]$\|it/s\]$" | tail -n 25 > "$OUT/peft.txt"
  ;;
steps)
  for fused in fused torch; do  # the elementwise fusions (add + RMSNorm, silu * up) on and off, same call
    timeout 80 python3 perf/bench_decode_step.py --shape llama3-8b --batch 64 --context 512 --adapters 0,8,32,64 \
      --norm $fused --silu-mul $fused --out "$WORK/$fused" > "$WORK/decode_step_$fused.txt" 2>&1
  done
  timeout 170 python3 -m perf.profile_engine --shape llama3-8b --adapters 0 100 --rate 24 --duration 12 --drain 12 \
    --admit-every-steps 4 --trace-steps 2 --trace-min-adapters 16 --out "$WORK/profile" > "$WORK/profile.txt" 2>&1
  timeout 150 python3 -m perf.bench_moe_step > "$WORK/moe_step.txt" 2>&1
  timeout 90 python3 perf/bench_sgmv_prefill.py --out "$WORK/sgmv.json" > "$WORK/sgmv.txt" 2>&1
  { for fused in fused torch; do echo "== decode step, elementwise $fused"; tail -n 8 "$WORK/decode_step_$fused.txt"; done
    echo "== MoE step"; tail -n 20 "$WORK/moe_step.txt"
    echo "== engine profile (trace in the tgz)"; grep -A3 "^== " "$WORK/profile.txt"; } > "$OUT/steps.txt" 2>&1
  ;;
*)
  echo "unknown part $PART (server, peft or steps)"; exit 2
  ;;
esac
tar czf "$OUT/$PART.tgz" -C /tmp "unmeasured_$PART" 2>/dev/null
cat "$OUT/$PART.txt"

#!/usr/bin/env bash
# Everything the issues ask to see on the H200, in one device call of under 10 minutes:
#   run from the repository root with .gpu carried (see perf/h200/env.sh):
#   bash perf/h200/all.sh $OUT
# 1. the model repository serving a bfloat16 checkpoint on CUDA through the real server (~1 min)
# 2. the engine's kernel path and CUDA-graph decode against PEFT / eager, compiled (~1 min)
# 3. the headline: S-LoRA workload on the Llama-3-8B shape, n = 5/100/1000/2000, base-only,
#    PEFT mixed and one-at-a-time at n = 100 (~6 min; its files go to $OUT/headline.tgz, since a
#    device call returns few files)
# Prints a short table last; everything else goes under $OUT.
set -u
OUT=${1:-/tmp/h200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${SKIP_SERVE:-0}" != 1 ]; then
  (bash perf/h200/serve_check.sh "$OUT/serve" > "$OUT/serve_check.txt" 2>&1)
fi
export PYTHONPATH=$PWD
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q tests/kernels/test_engine_kernels.py -p no:cacheprovider \
  > "$OUT/gpu_engine_tests.txt" 2>&1
timeout ${HEADLINE_TIMEOUT:-400} python3 -m perf.headline --shape llama3-8b --out /tmp/headline \
  --adapters 5 100 1000 2000 --rate ${RATE:-24} --duration ${DURATION:-12} --drain ${DRAIN:-20} \
  --peft-duration ${PEFT_DURATION:-15} --max-num-seqs ${MAX_NUM_SEQS:-128} --admit-every-steps ${ADMIT_EVERY:-4} \
  > "$OUT/headline.txt" 2>&1
tar czf "$OUT/headline.tgz" -C /tmp headline 2>/dev/null
echo "== server check"; grep -A3 "== adapter\|ready after\|refused alone" "$OUT/serve_check.txt" 2>/dev/null | head -40
echo "== GPU engine tests"; tail -2 "$OUT/gpu_engine_tests.txt"
echo "== headline"; tr '\r' '\n' < "$OUT/headline.txt" | grep -o "\[headline.*" | tail -14

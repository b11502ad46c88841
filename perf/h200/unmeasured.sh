#!/usr/bin/env bash
# What is still unmeasured on the H200 (updated in the fifth session of 2026-11-29), in three device calls of
# under 10 minutes each; run from the repository root with .gpu carried:
#   bash perf/h200/unmeasured.sh server $OUT   # the stub-health probe (PROBE_VARIANTS: one); the server
#                                              # latency sweep at 50/90% of SATURATION (default 12 req/s)
#                                              # with perf_analyzer on the first variant that works     ~9 min
#   bash perf/h200/unmeasured.sh peft $OUT     # engine n=100 vs PEFT mixed and one-at-a-time, 60 s PEFT
#                                              # runs (the 30x ratio; PEFT loads ~94 adapters in ~225 s) ~8 min
#   bash perf/h200/unmeasured.sh steps $OUT    # the MoE step (no LoRA / fused / unfused), then the whole-
#                                              # model decode step with the elementwise fusions on and off ~9 min
#   bash perf/h200/unmeasured.sh ab $OUT       # this tree against .baseline/ (carry it too): compiled engine
#                                              # tests, decode step with its kernels by GPU time, MoE step and
#                                              # the n=100 headline on request (AB_MOE=1, AB_HEADLINE=1)  ~5-9 min
#   bash perf/h200/unmeasured.sh moe_graphs $OUT # the MoE decode step in CUDA graphs: compiled engine tests,
#                                              # bench_moe_step --graphs at batch 1-256                     ~6 min
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
  # why the stub turns "not healthy" (perf/h200/server_probe.sh), per variant of engine parameters; then the
  # latency sweep with perf_analyzer on the first variant that finished every probe request
  PROBE_VARIANTS=${PROBE_VARIANTS:-""}
  PROBE_WORK=$WORK/probe_runs timeout 200 bash perf/h200/server_probe.sh "$WORK/probe" "$PROBE_VARIANTS" > "$WORK/probe.txt" 2>&1
  good=$(awk -F'|' 'NR > 3 && $4 + 0 > 0 && $4 + 0 == $5 + 0 {print $2; exit}' "$WORK/probe/probe.txt" | xargs)
  if [ -n "$good" ]; then
    EXTRA=""; for kv in $good; do [ "$kv" = defaults ] || EXTRA="$EXTRA --param $kv"; done
    EXTRA_PARAMS="$EXTRA" PERF_ANALYZER=1 SATURATION=${SATURATION:-12} DURATION=${DURATION:-10} timeout 330 \
      bash perf/h200/server_latency.sh "$WORK/server" > "$WORK/server_latency.txt" 2>&1
  fi
  {
    echo "== probe"; cat "$WORK/probe/probe.txt"; cat "$WORK/probe/probe_detail.txt" | head -120
    echo "== server latency with '${good:-no variant worked}'"; grep -E "ready after|saturation \|" "$WORK/server_latency.txt" | sort -u
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
  # the MoE step first (session 5 reached only batch 1 and 16 in 200 s; the unfused path is now timed
  # three times when one call is slower than 0.3 s), then the decode step with the elementwise fusions
  # on and off in the same call (a cold fused run took ~85 s)
  timeout 220 python3 -m perf.bench_moe_step > "$WORK/moe_step.txt" 2>&1
  for fused in fused torch; do
    timeout 140 python3 perf/bench_decode_step.py --shape llama3-8b --batch 64 --context 512 --adapters 0,8,32,64 \
      --norm $fused --silu-mul $fused --out "$WORK/$fused" > "$WORK/decode_step_$fused.txt" 2>&1
  done
  { echo "== MoE step"; tail -n 20 "$WORK/moe_step.txt"
    for fused in fused torch; do echo "== decode step, elementwise $fused"; tail -n 6 "$WORK/decode_step_$fused.txt"; done
  } > "$OUT/steps.txt" 2>&1
  ;;
ab)
  # this tree's engine code against the tree in .baseline/ (a previous commit's manylora/engine/, manylora/kernels/, perf/, with this
  # tree's bench_decode_step.py and bench_moe_step.py copied in: same harness, old engine), each in its own
  # processes: the compiled engine tests first (AB_TESTS=1), the whole decode step with its kernels by GPU time,
  # the eager MoE step (AB_MOE=1), then this tree's engine at n=100 and base-only on the headline trace (AB_HEADLINE=1)
  cp perf/bench_decode_step.py perf/bench_moe_step.py .baseline/perf/
  if [ "${AB_TESTS:-1}" = 1 ]; then
    TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
      tests/kernels/test_lora_batch.py::test_lora_batch_shrink_scratch > "$WORK/gpu_tests.txt" 2>&1
  fi
  for tree in baseline new; do
    dir=$PWD; [ $tree = baseline ] && dir=$PWD/.baseline
    (cd "$dir" && PYTHONPATH=$dir timeout 150 python3 perf/bench_decode_step.py --shape llama3-8b --batch 64 \
      --context 512 --adapters 0,8,32,64 --profile --out "$WORK/$tree") > "$WORK/decode_step_$tree.txt" 2>&1
    if [ "${AB_MOE:-0}" = 1 ]; then
      (cd "$dir" && PYTHONPATH=$dir timeout 100 python3 -m perf.bench_moe_step --batches 1 16 64 --adapters 8 \
        --unfused-max-batch 0) > "$WORK/moe_step_$tree.txt" 2>&1
    fi
  done
  if [ "${AB_HEADLINE:-0}" = 1 ]; then
    timeout 240 python3 -m perf.headline --shape llama3-8b --out "$WORK/headline" --adapters 100 --rate 24 \
      --duration 12 --drain 15 --skip-peft --max-num-seqs 128 --admit-every-steps 4 > "$WORK/headline.txt" 2>&1
  fi
  { [ -f "$WORK/gpu_tests.txt" ] && { echo "== compiled engine tests"; tail -n 4 "$WORK/gpu_tests.txt"; }
    for tree in baseline new; do echo "== decode step, $tree"; tail -n 5 "$WORK/decode_step_$tree.txt"; done
    for tree in baseline new; do echo "== step kernels, $tree"; grep -A5 -- "^-- " "$WORK/$tree/decode_step_kernels.txt"; done
    for tree in baseline new; do [ -f "$WORK/moe_step_$tree.txt" ] && { echo "== MoE step, $tree"; tail -n 5 "$WORK/moe_step_$tree.txt"; }; done
    [ -f "$WORK/headline.txt" ] && { echo "== headline"; tr '\r' '\n' < "$WORK/headline.txt" | grep -E "^\| engine|/ base|timings" ; }
  } > "$OUT/ab.txt" 2>&1
  ;;
moe_graphs)
  # the MoE decode step in CUDA graphs (branch moe-decode-graphs): the compiled engine test (graph replay == eager on
  # a tiny Qwen3-MoE, an inexpressible adapter on eager steps), then the Qwen3-30B-A3B step eager and replayed
  TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
    -k "moe" > "$WORK/gpu_tests.txt" 2>&1
  timeout 240 python3 -m perf.bench_moe_step --batches 1 16 64 256 --adapters 8 --unfused-max-batch 0 --graphs \
    > "$WORK/moe_step.txt" 2>&1
  { echo "== compiled MoE engine tests"; tail -n 4 "$WORK/gpu_tests.txt"
    echo "== MoE step, eager and graphs"; tail -n 12 "$WORK/moe_step.txt"; } > "$OUT/moe_graphs.txt" 2>&1
  ;;
*)
  echo "unknown part $PART (server, peft, steps, ab or moe_graphs)"; exit 2
  ;;
esac
tar czf "$OUT/$PART.tgz" -C /tmp "unmeasured_$PART" 2>/dev/null
cat "$OUT/$PART.txt"

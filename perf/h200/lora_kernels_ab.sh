#!/usr/bin/env bash
# The LoRA-kernel changes of 2026-11-30 (16-byte pool reads; decode_lora_kernels=sgmv) against a baseline tree,
# on an nvidia-h200-x2 machine (two GPUs: both trees at once), in device calls of under 10 minutes each.
# Run from the repository root with .gpu and the baseline carried, e.g. `git archive 491dc2a~6 backend kernels perf
# | tar -x -C .baseline_s9` (a094d92: session 8's tree):
#   bash perf/h200/lora_kernels_ab.sh kernels $OUT   # compiled kernel + engine tests (this tree), then the kernel
#                                                    # benchmark (GPU 1: this tree, forms bgmv and sgmv-device, then
#                                                    # the baseline's bgmv) beside the decode step (GPU 0: this tree
#                                                    # bgmv and sgmv, then the baseline)                     ~9 min
#   bash perf/h200/lora_kernels_ab.sh headline $OUT  # the headline on both trees at once (GPU 0 this tree with
#                                                    # DECODE_LORA=bgmv|sgmv and PREFILL=sdpa|paged, GPU 1 the
#                                                    # baseline with its defaults)                            ~6 min
#   bash perf/h200/lora_kernels_ab.sh server $OUT    # server latency at 50/90% of SATURATION and perf_analyzer
#                                                    # at concurrency 16 and request rates PA_RATES ("2 4 8") ~8 min
#   bash perf/h200/lora_kernels_ab.sh profile $OUT   # where the engine thread's time goes now: profile_engine
#                                                    # --python-profile at n = 2000 on both trees at once      ~5 min
# BASE (default .baseline_s9) names the baseline tree. Each part writes one log and one .tgz (a device call
# returns few files) and prints a short table last.
set -u
PART=${1:?part: kernels, headline, server or profile}
OUT=${2:-/tmp/h200}
ROOT=$PWD
BASE=${BASE:-$ROOT/.baseline_s9}
W=/tmp/ab_$PART
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(($(date +%s) - T0)) s" >> "$W/times.txt"; }

case "$PART" in
kernels)
  (
    export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT TRITON_INTERPRET=0
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_lora_kernels.py tests/kernels/test_lora_segments.py tests/kernels/test_lora_batch.py \
      tests/kernels/test_engine_kernels.py > "$W/gpu_tests.txt" 2>&1
    stamp "compiled tests" $?
    for form in bgmv sgmv; do
      timeout 90 python3 -m perf.bench_decode_step --decode-lora-kernels $form --out "$W/step_$form" \
        > "$W/step_$form.txt" 2>&1
      stamp "decode step $form" $?
    done
    (cd "$BASE" && PYTHONPATH=$BASE timeout 90 python3 -m perf.bench_decode_step --out "$W/step_base") \
      > "$W/step_base.txt" 2>&1
    stamp "decode step baseline" $?
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    PYTHONPATH=$ROOT timeout 200 python3 perf/bench_kernels.py --quick --forms bgmv,sgmv-device \
      --out "$W/kernels_new.jsonl" > "$W/kernels_new.txt" 2>&1
    stamp "bench_kernels new" $?
    (cd "$BASE" && PYTHONPATH=$BASE timeout 150 python3 perf/bench_kernels.py --quick --out "$W/kernels_base.jsonl") \
      > "$W/kernels_base.txt" 2>&1
    stamp "bench_kernels baseline" $?
  ) &
  wait
  {
    cat "$W/times.txt"
    echo "== compiled tests"; tail -n 3 "$W/gpu_tests.txt"
    for s in bgmv sgmv base; do echo "== decode step $s"; grep -E "adapters|ms" "$W/step_$s.txt" | tail -n 6; done
    echo "== LoRA kernels, decode shapes: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" "base=$W/kernels_base.jsonl" --tokens 1 16 64
  } > "$OUT/kernels_ab.txt" 2>&1
  ;;
headline)
  headline() {  # tree label gpu decode-lora-kernels
    mkdir -p "$W/work_$2"
    (cd "$1" && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=$1 timeout 330 python3 -m perf.headline --shape llama3-8b \
      --out "$W/hl_$2" --workdir "$W/work_$2" --adapters 5 100 1000 2000 --rate 24 --duration 12 --drain 15 \
      --skip-peft --max-num-seqs 128 --admit-every-steps 4 $4) > "$W/hl_$2.txt" 2>&1
    stamp "headline $2 (gpu $3)" $?
    rm -rf "$W/work_$2"
  }
  headline "$BASE" base 1 "" &
  headline "$ROOT" new 0 "--decode-lora-kernels ${DECODE_LORA:-bgmv} --prefill-attention ${PREFILL:-sdpa}"
  wait
  {
    cat "$W/times.txt"
    for t in new base; do echo "== headline $t"; grep -E "^\| engine" "$W/hl_$t/summary.md"; done
  } > "$OUT/headline_ab.txt" 2>&1
  ;;
server)
  EXTRA_PARAMS=${EXTRA_PARAMS:-} PERF_ANALYZER=1 PA_RATES=${PA_RATES:-"2 4 8"} SATURATION=${SATURATION:-14} \
    DURATION=${DURATION:-10} PA_MEASURE_MS=${PA_MEASURE_MS:-8000} timeout 540 \
    bash perf/h200/server_latency.sh "$W/server" > "$W/server_latency.txt" 2>&1
  stamp "server latency + perf_analyzer" $?
  {
    cat "$W/times.txt"
    grep -E "ready after|saturation \|" "$W/server_latency.txt" | sort -u
    echo "== perf_analyzer"; grep -E "^== |Throughput|latency|failed" "$W/server/perf_analyzer.txt" | head -40
  } > "$OUT/server.txt" 2>&1
  ;;
profile)
  profile() {  # tree label gpu
    (cd "$1" && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=$1 timeout 400 python3 -m perf.profile_engine --shape llama3-8b \
      --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4 --adapters 0 2000 \
      --python-profile --out "$W/prof_$2") > "$W/prof_$2.txt" 2>&1
    stamp "profile $2 (gpu $3)" $?
  }
  profile "$BASE" base 1 &
  profile "$ROOT" new 0
  wait
  {
    cat "$W/times.txt"
    for t in new base; do
      echo "== profile $t"; grep -E "^==|phase|graph:|eager:" "$W/prof_$t.txt"
      head -n 40 "$W/prof_$t/python_profile.txt" 2>/dev/null
    done
  } > "$OUT/profile_ab.txt" 2>&1
  ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
tar czf "$OUT/ab_$PART.tgz" -C /tmp "ab_$PART" 2>/dev/null
cat "$OUT"/*_ab.txt "$OUT/server.txt" 2>/dev/null

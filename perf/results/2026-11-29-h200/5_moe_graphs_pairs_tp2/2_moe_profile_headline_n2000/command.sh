#!/usr/bin/env bash
# Session 7, second call (two GPUs; main with the MoE decode graphs):
#   GPU 1: the Qwen3-30B-A3B MoE step, eager / replayed from CUDA graphs / unfused (batch <= 64), kernels by GPU time
#   GPU 0: the compiled MoE engine tests not reached in the first call, then the n=2000 headline (with base-only)
#          on this tree and on 2e8acfa (.baseline_s4/, session 4's 11.41 req/s), two samples each, the two trees
#          in parallel on the two GPUs where they overlap
set -u
OUT=${1:-/tmp/trial2}; W=/tmp/trial2; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
T0=$(date +%s); ROOT=$PWD
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
headline() {  # tree-dir label gpu; skipped when it could not end before 560 s into the call
  [ $(( $(date +%s) - T0 )) -gt 400 ] && { stamp "headline $2 skipped" -; return; }
  mkdir -p "$W/work_$2"
  (cd "$1" && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=$1 timeout 160 python3 -m perf.headline --shape llama3-8b \
    --out "$W/hl_$2" --workdir "$W/work_$2" --adapters 2000 --rate 24 --duration 12 --drain 15 --skip-peft \
    --max-num-seqs 128 --admit-every-steps 4) > "$W/hl_$2.txt" 2>&1
  stamp "headline $2 (gpu $3)" $?
}
gpu1() {
  CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$ROOT timeout 330 python3 -m perf.bench_moe_step --batches 1 16 64 256 \
    --adapters 1 8 32 --unfused-max-batch 64 --graphs --profile --out "$W/moe" > "$W/moe_step.txt" 2>&1
  stamp moe $?
  headline "$ROOT/.baseline_s4" s4_a 1
}
gpu1 &
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_engine_kernels.py tests/kernels/test_lora_kernels.py::test_lora_batch_shrink_scratch \
  -k "moe_kernel_path or shrink_scratch" > "$W/gpu_tests.txt" 2>&1
stamp tests $?
headline "$ROOT" head_a 0
headline "$ROOT/.baseline_s4" s4_b 0
headline "$ROOT" head_b 0
wait
{ cat "$W/times.txt"
  echo "== compiled engine tests (MoE kernel path vs PEFT, shrink scratch)"; tail -n 1 "$W/gpu_tests.txt"
  echo "== MoE step"; tail -n 30 "$W/moe_step.txt" | grep -v "^  "
  echo "== MoE step kernels, batch 64"; grep -A8 -- "^-- batch 64, " "$W/moe/moe_step_kernels.txt"
  echo "== headline n=2000"; for r in head_a s4_a s4_b head_b; do echo "-- $r"
    tr '\r' '\n' < "$W/hl_$r.txt" | grep -E "^\| engine|Traceback|Error" | head -4; done
} > "$OUT/trial2.txt" 2>&1
tar czf "$OUT/trial2.tgz" --exclude='work_*' -C /tmp trial2 2>/dev/null
cat "$OUT/trial2.txt"

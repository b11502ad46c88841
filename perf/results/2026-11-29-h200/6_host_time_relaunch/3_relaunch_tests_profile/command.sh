#!/usr/bin/env bash
# Session 8, third call (two GPUs): this tree's host-time cuts (prepared LoRA launches, Triton relaunch, pinned
# staging of adapter copies) on the GPU:
#   GPU 0: the compiled kernel and engine tests that cover them
#   GPU 1: profile_engine base-only / n=100 / n=2000 (default loader processes), this tree, then ab2cbea (.baseline_s8)
set -u
OUT=${1:-/tmp/s8r}; W=/tmp/s8r; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
ROOT=$PWD; T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
COMMON="--shape llama3-8b --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4 --adapters 0 100 2000"
gpu1() {
  for t in new base; do
    [ $(( $(date +%s) - T0 )) -gt 330 ] && { stamp "profile $t skipped" -; continue; }
    dir=$ROOT; [ $t = base ] && dir=$ROOT/.baseline_s8
    (cd "$dir" && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$dir timeout 250 python3 -m perf.profile_engine $COMMON \
       --out "$W/prof_$t") > "$W/prof_$t.txt" 2>&1; stamp "profile $t" $?
  done
}
gpu1 &
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout 420 python3 -m pytest -q -p no:cacheprovider -x \
  tests/test_pinned_copy.py tests/kernels/test_engine_kernels.py tests/kernels/test_lora_kernels.py \
  tests/kernels/test_add_rms_norm.py tests/kernels/test_silu_mul.py tests/kernels/test_paged_attention.py \
  tests/kernels/test_moe_graph_mode.py > "$W/gpu_tests.txt" 2>&1; stamp tests $?
wait
{ cat "$W/times.txt"; echo "== compiled tests"; tail -n 15 "$W/gpu_tests.txt" | grep -E "passed|failed|Error|assert" | tail -n 8
  for t in new base; do echo "== profile $t"; grep -E "^==|phase|graph:|eager:" "$W/prof_$t.txt"; done
} > "$OUT/s8r.txt" 2>&1
tar czf "$OUT/s8r.tgz" -C /tmp s8r 2>/dev/null
cat "$OUT/s8r.txt"

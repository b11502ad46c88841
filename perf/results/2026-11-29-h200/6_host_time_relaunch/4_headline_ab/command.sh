#!/usr/bin/env bash
# Session 8, fourth call (two GPUs): the headline (base-only, n = 5, 100, 1000, 2000) on this tree (GPU 0) and on
# ab2cbea (.baseline_s8, GPU 1) at once, one process each; then the compiled tests the third call did not reach.
set -u
OUT=${1:-/tmp/s8h}; W=/tmp/s8h; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
ROOT=$PWD; T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
headline() {  # tree-dir label gpu
  mkdir -p "$W/work_$2"
  (cd "$1" && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=$1 timeout 330 python3 -m perf.headline --shape llama3-8b \
    --out "$W/hl_$2" --workdir "$W/work_$2" --adapters 5 100 1000 2000 --rate 24 --duration 12 --drain 15 \
    --skip-peft --max-num-seqs 128 --admit-every-steps 4) > "$W/hl_$2.txt" 2>&1
  stamp "headline $2 (gpu $3)" $?
  rm -rf "$W/work_$2"
}
headline "$ROOT/.baseline_s8" base 1 &
headline "$ROOT" new 0
wait
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_lora_kernels.py::test_prepared_launch_serves_every_layer tests/kernels/test_add_rms_norm.py \
  tests/kernels/test_silu_mul.py tests/kernels/test_paged_attention.py tests/kernels/test_moe_graph_mode.py \
  > "$W/gpu_tests.txt" 2>&1; stamp tests $?
{ cat "$W/times.txt"; echo "== compiled tests"; tail -n 3 "$W/gpu_tests.txt"
  for t in new base; do echo "== headline $t"; grep -E "^\| engine" "$W/hl_$t/summary.md"; done
} > "$OUT/s8h.txt" 2>&1
tar czf "$OUT/s8h.tgz" -C /tmp s8h 2>/dev/null
cat "$OUT/s8h.txt"

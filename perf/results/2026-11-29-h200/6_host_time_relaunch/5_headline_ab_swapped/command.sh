#!/usr/bin/env bash
# Session 8, fifth call (two GPUs): the headline (base-only, n = 5, 100, 1000, 2000) on this tree (GPU 1) and on
# ab2cbea (.baseline_s8, GPU 0) at once, one process each: the fourth call with the GPUs swapped.
set -u
OUT=${1:-/tmp/s8i}; W=/tmp/s8i; mkdir -p "$OUT" "$W"
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
headline "$ROOT/.baseline_s8" base 0 &
headline "$ROOT" new 1
wait
{ cat "$W/times.txt"; for t in new base; do echo "== headline $t"; grep -E "^\| engine" "$W/hl_$t/summary.md"; done
} > "$OUT/s8i.txt" 2>&1
tar czf "$OUT/s8i.tgz" -C /tmp s8i 2>/dev/null
cat "$OUT/s8i.txt"

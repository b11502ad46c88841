#!/usr/bin/env bash
# Session 7, third call (two GPUs): the MoE-LoRA kernels' pair form against the block form, and the compiled
# tests of this tree (the MoE graph tables fix, the pair form):
#   GPU 0: Qwen3-30B-A3B MoE step, eager and replayed, --lora-form blocks; then tests/kernels/test_engine_kernels.py
#   GPU 1: the same with --lora-form pairs (+ kernels by GPU time); then test_fused_moe_lora.py and
#          test_moe_graph_mode.py compiled; then how long a tiny MoE engine takes to start with its decode graphs
set -u
OUT=${1:-/tmp/trial3}; W=/tmp/trial3; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"; }
left() { echo $(( 560 - ($(date +%s) - T0) )); }
bench() {  # form gpu extra
  CUDA_VISIBLE_DEVICES=$2 timeout 210 python3 -m perf.bench_moe_step --batches 1 16 64 256 --adapters 1 8 32 \
    --unfused-max-batch 0 --graphs --lora-form "$1" ${3:-} --out "$W/moe_$1" > "$W/moe_$1.txt" 2>&1
  stamp "bench $1" $?
}
gpu1() {
  bench pairs 1 --profile
  CUDA_VISIBLE_DEVICES=1 TRITON_INTERPRET=0 timeout $(( $(left) < 170 ? $(left) : 170 )) python3 -m pytest -q \
    -p no:cacheprovider tests/kernels/test_fused_moe_lora.py tests/kernels/test_moe_graph_mode.py > "$W/tests_gpu1.txt" 2>&1
  stamp "tests gpu1" $?
  CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) < 100 ? $(left) : 100 )) python3 - > "$W/startup.txt" 2>&1 <<'PY'
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "tests")
from model_factory import make_moe_base
from backend.config import EngineConfig
from backend.engine import Engine
base = make_moe_base(Path(tempfile.mkdtemp()) / "base", "qwen3_moe", seed=61, head_dim=24)
for graphs in (False, True):
    t = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=str(base), device="cuda", dtype="bfloat16", cuda_graphs=graphs))
    print(f"tiny Qwen3-MoE engine, cuda_graphs={graphs}: started in {time.perf_counter() - t:.1f} s, buckets "
          f"{engine.graphs.buckets if engine.graphs else None}", flush=True)
    engine.shutdown()
PY
  stamp startup $?
}
gpu1 &
bench blocks 0
CUDA_VISIBLE_DEVICES=0 TRITON_INTERPRET=0 timeout $(( $(left) < 330 ? $(left) : 330 )) python3 -m pytest -q \
  -p no:cacheprovider tests/kernels/test_engine_kernels.py tests/kernels/test_lora_kernels.py::test_lora_batch_shrink_scratch \
  --durations=6 > "$W/tests_gpu0.txt" 2>&1
stamp "tests gpu0" $?
wait
{ cat "$W/times.txt"
  echo "== compiled tests"; tail -n 1 "$W/tests_gpu1.txt"; grep -E "passed|failed|FAILED|slowest|s call" "$W/tests_gpu0.txt" | tail -n 12
  echo "== startup"; grep "tiny Qwen3" "$W/startup.txt"
  for f in blocks pairs; do echo "== MoE step, $f"; grep -E "^ +[0-9]+ +[0-9]+ \||graphs \|" "$W/moe_$f.txt"; done
  echo "== kernels, pairs, batch 64"; grep -A7 -- "^-- batch 64, 8 adapters" "$W/moe_pairs/moe_step_kernels.txt"
} > "$OUT/trial3.txt" 2>&1
tar czf "$OUT/trial3.tgz" -C /tmp trial3 2>/dev/null
cat "$OUT/trial3.txt"

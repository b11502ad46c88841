#!/usr/bin/env bash
# Session 7 trial (branch gpu-trial = main + moe-decode-graphs + lora-pdl), one device call:
#   1. tp=2 on NCCL against tp=1 (perf/h200/tp_smoke.py) when two GPUs are there
#   2. GPU 0: compiled engine tests (PDL on; MoE graph replay == eager), then the decode step with the LoRA
#      kernels as programmatic dependent launches off and on (MANYLORA_LORA_PDL=0/1), kernels by GPU time
#   3. GPU 1 (or after 2 on one GPU): the Qwen3-30B-A3B MoE step eager and replayed from CUDA graphs
set -u
OUT=${1:-/tmp/trial}; W=/tmp/trial; mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T0=$(date +%s)
nvidia-smi -L > "$W/gpus.txt"; NGPU=$(grep -c "^GPU" "$W/gpus.txt")
if [ "$NGPU" -ge 2 ]; then
  PYTHONPATH=$PWD:$PWD/tests timeout 150 python3 perf/h200/tp_smoke.py > "$W/tp_smoke.txt" 2>&1
  echo "tp_smoke rc=$? at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"
fi
moe() {
  timeout 300 python3 -m perf.bench_moe_step --batches 1 16 64 --adapters 8 --unfused-max-batch 0 --graphs \
    > "$W/moe_step.txt" 2>&1
  echo "moe rc=$? at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"
}
[ "$NGPU" -ge 2 ] && { CUDA_VISIBLE_DEVICES=1 moe & }
export CUDA_VISIBLE_DEVICES=0
TRITON_INTERPRET=0 timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
  tests/kernels/test_lora_kernels.py::test_lora_batch_shrink_scratch > "$W/gpu_tests.txt" 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"
for pdl in 0 1; do
  MANYLORA_LORA_PDL=$pdl timeout 130 python3 perf/bench_decode_step.py --shape llama3-8b --batch 64 --context 512 \
    --adapters 0,8,32,64 --profile --out "$W/pdl$pdl" > "$W/decode_pdl$pdl.txt" 2>&1
  echo "decode pdl=$pdl rc=$? at $(( $(date +%s) - T0 )) s" >> "$W/times.txt"
done
if [ "$NGPU" -ge 2 ]; then wait; else moe; fi
{ cat "$W/gpus.txt" "$W/times.txt"
  [ -f "$W/tp_smoke.txt" ] && { echo "== tp smoke (NCCL)"; tail -n 4 "$W/tp_smoke.txt"; }
  echo "== compiled engine tests"; grep -E "passed|failed|FAILED|Error" "$W/gpu_tests.txt" | tail -n 8
  for pdl in 0 1; do echo "== decode step, PDL $pdl"; tail -n 5 "$W/decode_pdl$pdl.txt"; done
  for pdl in 0 1; do echo "== step kernels, PDL $pdl"; grep -A4 -- "^-- 8 " "$W/pdl$pdl/decode_step_kernels.txt"; done
  echo "== MoE step, eager and graphs"; tail -n 12 "$W/moe_step.txt"
} > "$OUT/trial.txt" 2>&1
tar czf "$OUT/trial.tgz" -C /tmp trial 2>/dev/null
cat "$OUT/trial.txt"

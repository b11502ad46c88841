#!/usr/bin/env bash
# TTFT and ITL through the Triton server (gRPC streaming, the generator model) at 50% and 90% of a
# saturating rate, Llama-3-8B shape, random bf16 weights, 100 rank-16 adapters, S-LoRA's workload.
#   SATURATION=<req/s measured by perf.headline> bash perf/h200/server_latency.sh $OUT
set -u
OUT=${1:-/tmp/server_latency}
SAT=${SATURATION:?set SATURATION to the saturating rate (req/s) the headline measured}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 - <<'PY'
from perf.checkpoint import SHAPES, write_adapter_catalogue, write_base
shape = SHAPES["llama3-8b"]
write_base("/tmp/ckpt8b", shape)
write_adapter_catalogue("/tmp/ckpt8b_adapters", shape, [f"lora-{i:04d}" for i in range(100)], distinct=8)
PY
source perf/h200/env.sh
python scripts/serve.py --base-model /tmp/ckpt8b --adapters /tmp/ckpt8b_adapters/catalogue.json --param device=cuda \
  --param max_num_seqs=64 --param max_loras=64 --param max_model_len=1100 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do curl -sf localhost:8000/v2/models/generator/ready >/dev/null 2>&1 && break; sleep 1; done
echo "server ready after ${i}s"
for frac in 0.5 0.9; do
  rate=$(python3 -c "print(round($SAT * $frac, 2))")
  python3 -m perf.workload --adapters 100 --alpha 1 --rate "$rate" --cv 1 --duration 30 --vocab-range 4 128256 \
    --out "$OUT/trace_$frac.jsonl"
  python -m perf.runner --trace "$OUT/trace_$frac.jsonl" --url 127.0.0.1:8001 --model generator \
    --name "server_${frac}_of_saturation" --max-duration 90 --no-progress --out "$OUT"
done
kill $SERVER; wait $SERVER 2>/dev/null
cat "$OUT"/summary.md 2>/dev/null || ls "$OUT"

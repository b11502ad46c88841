#!/usr/bin/env bash
# The model repository on the H200: a bfloat16 checkpoint (the embedded default, converted) served on
# CUDA by the real tritonserver, driven with the client CLI. Run from the repository root:
#   bash perf/h200/serve_check.sh $OUT
set -u
OUT=${1:-/tmp/serve_check}
mkdir -p "$OUT"
# the build and the bf16 conversion use the image's python3 (numpy 2: its transformers needs it);
# the server's stub and the client use the venv from env.sh (numpy 1.26 for the 2.51 stub)
export PYTHONPATH=$PWD
python3 -m manylora.embedded.build --out /tmp/default > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 - <<'PY'
import shutil, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained("/tmp/default/base", dtype=torch.bfloat16)
m.save_pretrained("/tmp/bf16")
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    try:
        shutil.copy(f"/tmp/default/base/{f}", f"/tmp/bf16/{f}")
    except FileNotFoundError:
        pass
import json; print("checkpoint dtype:", json.load(open("/tmp/bf16/config.json")).get("dtype"))
PY
source perf/h200/env.sh || exit 2
python scripts/serve.py --base-model /tmp/bf16 --adapters /tmp/default/catalogue.json --param device=cuda \
  --http-port 8000 --grpc-port 8001 --metrics-port 8002 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 120); do
  curl -sf localhost:8000/v2/models/llm/ready >/dev/null 2>&1 && break
  sleep 1
done
echo "== ready after ${i}s"
python -m manylora.client adapters list
python -m manylora.client stats | tr ',' '\n' | grep -E '"(device|dtype|kernels|pool_pages_total|adapters_resident)"' || python -m manylora.client stats
for a in "" shout pirate whisper numbers; do
  echo "== adapter '${a:-base}' (streamed over gRPC)"
  python -m manylora.client generate ${a:+--adapter $a} --max-tokens 24 "Every Saturday there is a market"
  echo
done
echo "== /generate (HTTP, one response)"
curl -s -X POST localhost:8000/v2/models/llm/generate \
  -d '{"text_input": "Every Saturday there is a market", "max_tokens": 24, "lora_name": "shout"}'
echo
echo "== a bad request is refused alone"
python -m manylora.client generate --adapter no-such-adapter "hello" 2>&1 | tail -1
curl -sf localhost:8000/v2/health/ready && echo "server ready"
kill $SERVER; wait $SERVER 2>/dev/null
grep -iE "error|exception" "$OUT/server.log" | grep -v "no-such-adapter" | head -5

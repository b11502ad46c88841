#!/usr/bin/env bash
# TTFT and ITL through the Triton server (gRPC streaming, the generator model) at 50% and 90% of a
# saturating rate: random weights of SHAPE, 100 rank-16 adapters, S-LoRA's workload.
#   SATURATION=<req/s measured by perf.headline> bash perf/h200/server_latency.sh $OUT
# On the H200 (defaults: SHAPE=llama3-8b DEVICE=cuda, env.sh for the server's Python). A CPU dry run
# of the same steps: SHAPE=tiny DEVICE=cpu USE_ENV_SH=0 PYTHON=.venv/bin/python SATURATION=4 DURATION=5
set -u
OUT=${1:-/tmp/server_latency}
SAT=${SATURATION:?set SATURATION to the saturating rate (req/s) the headline measured}
SHAPE=${SHAPE:-llama3-8b}
DEVICE=${DEVICE:-cuda}
DURATION=${DURATION:-30}
PYTHON=${PYTHON:-python3}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=$((HTTP_PORT + 1))
CKPT=${CKPT:-/tmp/ckpt_$SHAPE}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source perf/h200/server_common.sh
if [ "${USE_ENV_SH:-1}" = 1 ]; then source perf/h200/env.sh || exit 2; SERVE_PY=python; else SERVE_PY=$PYTHON; fi
start_server "$OUT/server.log" "$HTTP_PORT" ${EXTRA_PARAMS:-}
wait_ready "$HTTP_PORT" 300
echo "server ready after ${READY_S}s"
for frac in ${FRACTIONS-0.5 0.9}; do  # FRACTIONS= (empty): perf_analyzer only
  rate=$("$PYTHON" -c "print(round($SAT * $frac, 2))")
  "$PYTHON" -m perf.workload --adapters 100 --alpha 1 --rate "$rate" --cv 1 --duration "$DURATION" \
    --input-range "$IN_LO" "$IN_HI" --output-range "$OUT_LO" "$OUT_HI" --vocab-range 4 "$VOCAB" \
    --out "$OUT/trace_$frac.jsonl"
  $SERVE_PY -m perf.runner --trace "$OUT/trace_$frac.jsonl" --url "127.0.0.1:$GRPC_PORT" --model generator \
    --name "server_${frac}_of_saturation" --max-duration $((DURATION * 3)) --no-progress --out "$OUT"
done
if [ "${PERF_ANALYZER:-0}" = 1 ]; then  # perf_analyzer against the same server (perf/perf_analyzer/run.sh)
  ADAPTERS=$("$PYTHON" -c "from perf.workload import adapter_name; print(*(adapter_name(i) for i in range(100)))") \
  VOCAB="4 $VOCAB" URL="127.0.0.1:$GRPC_PORT" OUT_DIR="$OUT/perf_analyzer" PYTHON="$SERVE_PY" \
  CONCURRENCY="${PA_CONCURRENCY:-16}" RATES="${PA_RATES:-4}" MEASURE_MS="${PA_MEASURE_MS:-8000}" \
    bash perf/perf_analyzer/run.sh > "$OUT/perf_analyzer.txt" 2>&1
fi
# every thread's stack of the generator's stub into server.log (faulthandler, registered by the model)
pkill -USR1 -f "triton_python_backend_stub.*generator" 2>/dev/null && sleep 2
kill $SERVER; wait $SERVER 2>/dev/null
cat "$OUT"/summary.md 2>/dev/null || ls "$OUT"

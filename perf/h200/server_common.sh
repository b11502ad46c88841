# Sourced by the H200 server scripts (needs SHAPE, CKPT, DEVICE, PYTHON): writes random weights of $SHAPE
# (a base and a catalogue of 100 rank-16 adapters, 8 distinct weight files) under $CKPT unless they are
# there; sets VOCAB, MAX_LEN and the workload's IN_LO IN_HI OUT_LO OUT_HI for that shape; defines
# start_server and wait_ready.
read -r VOCAB MAX_LEN IN_LO IN_HI OUT_LO OUT_HI < <("$PYTHON" - "$SHAPE" "$CKPT" "$DEVICE" <<'PY'
import sys
from pathlib import Path
from perf.checkpoint import SHAPES, write_adapter_catalogue, write_base
from perf.headline import DEFAULTS
from perf.workload import adapter_name
shape, ckpt = SHAPES[sys.argv[1]], sys.argv[2]
dev = "cuda" if sys.argv[3].startswith("cuda") else "cpu"  # random weights drawn on the GPU are quick
if not (Path(ckpt) / "adapters" / "catalogue.json").exists():
    write_base(f"{ckpt}/base", shape, device=dev)
    write_adapter_catalogue(f"{ckpt}/adapters", shape, [adapter_name(i) for i in range(100)], distinct=8, device=dev)
d = DEFAULTS[sys.argv[1]]
print(shape.vocab, d["input_range"][1] + d["output_range"][1] + 8, *d["input_range"], *d["output_range"])
PY
)

# start_server LOG HTTP_PORT [serve.py args...]: the generator on that checkpoint in the background
# (gRPC on HTTP_PORT + 1, metrics on + 2); SERVER is its pid. Needs SERVE_PY (env.sh's python or $PYTHON).
start_server() {
  local log=$1 http=$2
  shift 2
  $SERVE_PY scripts/serve.py --base-model "$CKPT/base" --adapters "$CKPT/adapters/catalogue.json" \
    --param device="$DEVICE" --param max_num_seqs=64 --param max_loras=64 --param max_model_len="$MAX_LEN" "$@" \
    --http-port "$http" --grpc-port $((http + 1)) --metrics-port $((http + 2)) > "$log" 2>&1 &
  SERVER=$!
}

# wait_ready HTTP_PORT LIMIT_S: until the generator is ready (or LIMIT_S); READY_S is the seconds it took.
wait_ready() {
  local t0
  t0=$(date +%s)
  for _ in $(seq 1 "$2"); do curl -sf "localhost:$1/v2/models/generator/ready" >/dev/null 2>&1 && break; sleep 1; done
  READY_S=$(( $(date +%s) - t0 ))
}

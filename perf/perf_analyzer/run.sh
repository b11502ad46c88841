#!/usr/bin/env bash
# perf_analyzer against a running manylora server: generator (token ids) and llm (text), gRPC streaming,
# a concurrency sweep and a request-rate sweep; CSV + profile JSON per point under $OUT_DIR.
#
#   perf/perf_analyzer/run.sh                       # server on localhost:8001, inputs from this folder
#   URL=host:8001 ADAPTERS="lora-0000 lora-0001" VOCAB="4 128256" OUT_DIR=/tmp/pa perf/perf_analyzer/run.sh
#
# perf_analyzer needs glibc >= 2.38 (the H200 machine; see /work/shared/GPU.md): PA_BIN, or the
# binary inside the perf-analyzer wheel carried in .gpu/pa (unpacked to /tmp/pa on first use).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
URL="${URL:-localhost:8001}"
OUT_DIR="${OUT_DIR:-${OUT:-$REPO/perf/results/$(date +%F)}/perf_analyzer}"
CONCURRENCY="${CONCURRENCY:-1 4 16 64}"
RATES="${RATES:-1 2 4 8}"
MEASURE_MS="${MEASURE_MS:-10000}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT_DIR"

if [[ -z "${PA_BIN:-}" ]]; then
  if command -v perf_analyzer >/dev/null && perf_analyzer --help 2>&1 | grep -q concurrency-range; then
    PA_BIN="$(command -v perf_analyzer)"
  else
    wheel="$(ls "$REPO"/.gpu/pa/perf_analyzer-*.whl 2>/dev/null | head -1)"
    [[ -n "$wheel" ]] || { echo "no perf_analyzer: set PA_BIN or put the wheel in .gpu/pa" >&2; exit 2; }
    mkdir -p /tmp/pa && (cd /tmp/pa && "$PYTHON" -m zipfile -e "$wheel" .)
    PA_BIN="$(find /tmp/pa -path '*bin/perf_analyzer' -type f | head -1)"
    chmod +x "$PA_BIN"
  fi
fi
echo "perf_analyzer: $PA_BIN; server: $URL; results: $OUT_DIR"

INPUTS="$HERE"
if [[ -n "${ADAPTERS:-}" || -n "${VOCAB:-}" ]]; then  # inputs for another model / catalogue
  INPUTS="$OUT_DIR/inputs"
  # shellcheck disable=SC2086
  "$PYTHON" "$HERE/make_inputs.py" --adapters ${ADAPTERS:-} --vocab-range ${VOCAB:-4 256} --out-dir "$INPUTS"
fi

run_pa() {  # model, input file, tag, load args...
  local model="$1" input="$2" tag="$3"; shift 3
  echo "== $model $tag"
  "$PA_BIN" -m "$model" -i grpc -u "$URL" --async --streaming --input-data "$input" \
    --measurement-interval "$MEASURE_MS" --stability-percentage 50 --max-trials 3 \
    -f "$OUT_DIR/${model}_${tag}.csv" --profile-export-file "$OUT_DIR/${model}_${tag}.json" "$@" \
    > "$OUT_DIR/${model}_${tag}.log" 2>&1 || echo "   failed: see $OUT_DIR/${model}_${tag}.log"
  tail -n 4 "$OUT_DIR/${model}_${tag}.log" | sed 's/^/   /'
}

for model in generator llm; do
  for c in $CONCURRENCY; do
    run_pa "$model" "$INPUTS/${model}_input.json" "c$c" --concurrency-range "$c"
  done
  for r in $RATES; do
    run_pa "$model" "$INPUTS/${model}_input.json" "r$r" --request-rate-range "$r"
  done
done
echo "done: $OUT_DIR"

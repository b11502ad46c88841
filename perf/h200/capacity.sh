#!/usr/bin/env bash
# perf/capacity.py on the H200 (llama3-8b shape), one call of the device runner; carry .gpu (perf/h200/env.sh
# makes the server's venv from it on a fresh machine). Arguments go to perf.capacity, e.g.:
#   bash perf/h200/capacity.sh --targets engine --parts offline
#   bash perf/h200/capacity.sh --targets server_stream --parts sweep --sweep-fractions 0.5,0.7,0.8
# Results merge in /tmp/manylora-capacity while the machine stays warm; $OUT gets summary.json, summary.md,
# store.json (for `python -m perf.capacity --merge` of calls on different machines), the plots,
# runs_and_logs.tar.gz and capacity.log: at most 7 files, as a device call brings back 8.
set -o pipefail
export PYTHONUNBUFFERED=1
source perf/h200/env.sh || exit 2
OUT=${OUT:-/tmp/capacity_out}
mkdir -p "$OUT"
python -m perf.capacity --shape llama3-8b "$@" 2>&1 | tee "$OUT/capacity.log"

#!/usr/bin/env bash
# Why the generator's stub answers "not healthy" on the H200 with the Llama-3-8B shape (it does not with the
# tiny shape): per variant of engine parameters, start the server, send a few short requests one by one, and
# sample the stub process meanwhile: every thread's state and wait channel, its CPU time, the cgroup's CPU
# throttling and memory events, every 0.5 s; a py-spy dump (Python and native frames) of the stub a few
# seconds into the first request. The Python backend's parent calls a stub unhealthy when the stub's health
# thread (a C++ thread that needs no GIL) has not set its flag within one second.
#   bash perf/h200/server_probe.sh $OUT "" "adapter_load_processes=0" "cuda_graphs=false"
# Each argument after OUT is one variant: space-separated key=value engine parameters ("" = defaults).
# Writes $OUT/probe.txt (the short table) and $OUT/probe.tgz (server logs, samples, dumps).
set -u
OUT=${1:-/tmp/server_probe}
shift
VARIANTS=("$@")
[ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=("")
SHAPE=${SHAPE:-llama3-8b}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
CKPT=${CKPT:-/tmp/ckpt_$SHAPE}
WORK=${PROBE_WORK:-/tmp/server_probe}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
source perf/h200/server_common.sh
if [ "${USE_ENV_SH:-1}" = 1 ]; then source perf/h200/env.sh || exit 2; SERVE_PY=python; else SERVE_PY=$PYTHON; fi
PYSPY=""
if [ -f .gpu/tools/py-spy.xz ]; then xz -dc .gpu/tools/py-spy.xz > /tmp/py-spy && chmod +x /tmp/py-spy && PYSPY=/tmp/py-spy; fi
"$PYTHON" -m perf.workload --adapters 100 --alpha 1 --rate 1 --cv 1 --duration 4 --input-range 16 64 \
  --output-range 8 24 --vocab-range 4 "$VOCAB" --out "$WORK/trace.jsonl" > /dev/null

sample_stub() {  # $1: file; one block per 0.5 s
  while true; do
    echo "@ $(date +%s.%N)"
    for p in $(pgrep -f "triton_python_backend_stub.*generator"); do
      echo "pid $p state $(awk '{print $3, "utime", $14, "stime", $15, "threads", $20}' /proc/$p/stat 2>/dev/null)"
      for t in /proc/$p/task/*; do
        printf '  %s %s %s %s\n' "$(basename "$t")" "$(awk '{print $3}' "$t/stat" 2>/dev/null)" \
          "$(cat "$t/comm" 2>/dev/null)" "$(cat "$t/wchan" 2>/dev/null)"
      done | awk '$2 == "S" {s++; next} {print} END {print "  sleeping threads:", s + 0}'
    done
    echo "cpu.stat $(tr '\n' ' ' < /sys/fs/cgroup/cpu.stat 2>/dev/null)"
    echo "memory.events $(tr '\n' ' ' < /sys/fs/cgroup/memory.events 2>/dev/null) current $(cat /sys/fs/cgroup/memory.current 2>/dev/null)"
    grep -E "^(MemAvailable|Dirty|Writeback):" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo
    sleep 0.5
  done > "$1" 2>&1
}

stop_server() {
  pkill -9 -f "tritonserver" 2>/dev/null
  pkill -9 -f triton_python_backend_stub 2>/dev/null
  sleep 3
}

{
echo "cores $(nproc), cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null), memory.max $(cat /sys/fs/cgroup/memory.max 2>/dev/null)"
echo "| variant | ready (s) | sent | done | errors | stub threads in D/R (max) | throttled (s) | oom events |"
echo "|---|---|---|---|---|---|---|---|"
} > "$OUT/probe_head.txt"
: > "$OUT/probe_rows.txt"
i=0
for variant in "${VARIANTS[@]}"; do
  i=$((i + 1))
  V="$WORK/v$i"
  mkdir -p "$V"
  echo "$variant" > "$V/variant.txt"
  params=()
  for kv in $variant; do params+=(--param "$kv"); done
  start_server "$V/server.log" 8000 "${params[@]}"
  wait_ready 8000 240
  ready=$READY_S
  throttled0=$(awk '/throttled_usec/ {print $2}' /sys/fs/cgroup/cpu.stat 2>/dev/null || echo 0)
  sample_stub "$V/samples.txt" &
  SAMPLER=$!
  (for at in 2 8; do  # a dump 2 s and 8 s into the first request, both Python-only and with native frames
     sleep $((at == 2 ? 2 : 6))
     for p in $(pgrep -f "triton_python_backend_stub.*generator"); do
       [ -n "$PYSPY" ] || continue
       timeout 30 $PYSPY dump --pid "$p" --native > "$V/pyspy_native_${at}s.txt" 2>&1
       timeout 30 $PYSPY dump --pid "$p" > "$V/pyspy_${at}s.txt" 2>&1
     done
   done) &
  DUMPER=$!
  $SERVE_PY -m perf.runner --trace "$WORK/trace.jsonl" --url 127.0.0.1:8001 --model generator --name "probe_v$i" \
    --max-duration 30 --no-progress --out "$V" > "$V/runner.txt" 2>&1
  wait $DUMPER
  pkill -USR1 -f "triton_python_backend_stub.*generator" 2>/dev/null && sleep 2
  kill $SAMPLER 2>/dev/null
  throttled1=$(awk '/throttled_usec/ {print $2}' /sys/fs/cgroup/cpu.stat 2>/dev/null || echo 0)
  stop_server
  sent=$(wc -l < "$WORK/trace.jsonl")
  done_n=$(grep -c '"error": null' "$V"/*requests*.jsonl 2>/dev/null | awk -F: '{s += $NF} END {print s + 0}')
  errors=$(grep -ho '"error": "[^"]*"' "$V"/*requests*.jsonl 2>/dev/null | sort | uniq -c | head -3 | tr '\n' ';')
  dr=$(awk '/^  [0-9]+ [DR] / {n++} /^@/ {if (n > m) m = n; n = 0} END {print m + 0}' "$V/samples.txt")
  oom=$(grep -o "oom_kill [0-9]*" "$V/samples.txt" | tail -1)
  echo "| ${variant:-defaults} | $ready | $sent | $done_n | ${errors:-none} | $dr | $(( (throttled1 - throttled0) / 1000000 )) | ${oom:-?} |" >> "$OUT/probe_rows.txt"
done
cat "$OUT/probe_head.txt" "$OUT/probe_rows.txt" > "$OUT/probe.txt"
{
  echo "== generator stub stacks (py-spy, native) of variant 1, 2 s in"; head -150 "$WORK/v1/pyspy_native_2s.txt" 2>/dev/null
  echo "== stub stacks (faulthandler, SIGUSR1) of variant 1"; grep -A25 "^Thread 0x\|^Current thread" "$WORK/v1/server.log" | head -120
  echo "== stub threads not sleeping, variant 1 (first 60 lines)"; grep -v "^cpu.stat\|^memory\|^MemAvail" "$WORK/v1/samples.txt" | head -60
} > "$OUT/probe_detail.txt"
tar czf "$OUT/probe.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" 2>/dev/null
cat "$OUT/probe.txt"

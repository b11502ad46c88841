#!/usr/bin/env bash
# The H200 calls of a session lent one GPU (nvidia-h200): each part is one device call of under 10 minutes,
# run serially on GPU 0, writing one log folder tarred into $OUT and printing a short table last.
# From the repository root, with .gpu (server parts) and the baseline tree BASE (default .baseline_s9, e.g.
# `git archive a094d92 backend kernels perf tests/kernels | tar -x -C .baseline_s9`) carried:
#   bash perf/h200/one_gpu.sh kernels $OUT   # compiled kernel + engine tests; decode step of this tree (bgmv and
#                                            # sgmv in one process) and of BASE; kernel benchmark of this tree
#                                            # (bgmv, sgmv-device)                                         ~9 min
#   bash perf/h200/one_gpu.sh forms $OUT     # the decode-step LoRA forms bgmv / sgmv / hybrid: compiled tests,
#                                            # decode step of each, the headline with the fastest, kernel A/B ~9 min
#   bash perf/h200/one_gpu.sh expand $OUT    # BGMV expand without its 16-byte paths: compiled tests, decode step
#                                            # A/B against BASE, kernel benchmark, the headline          ~9 min
#   bash perf/h200/one_gpu.sh headline $OUT  # the headline (base-only, n = 5, 100, 1000, 2000), then the
#                                            # engine thread's profile at n = 5 and n = 2000               ~9 min
#   bash perf/h200/one_gpu.sh mixed $OUT     # mixed-step graphs: compiled tests, the headline with them and (n = 5,
#                                            # 2000) without them, in one command                          ~9.5 min
#   bash perf/h200/one_gpu.sh final $OUT     # the server's TTFT at 50/90% of SATURATION, the headline, and the
#                                            # headline at n = 5, 2000 with LOAD_PROCESSES loaders       ~9.5 min
#   bash perf/h200/one_gpu.sh profile $OUT   # engine step phases at n = 5 / 2000, cProfile + eager-step trace at
#                                            # n = 2000, the server's TTFT at 50/90% of SATURATION       ~8 min
#   bash perf/h200/one_gpu.sh rows $OUT      # the row-streaming BGMV expand: compiled tests, the expand sweep (old
#                                            # tile body vs rows, configs), decode step A/B against BASE, kernels ~8 min
#   bash perf/h200/one_gpu.sh rows_ab $OUT   # the expand heuristic (tile / rows): compiled tests, decode step A/B
#                                            # against BASE, kernel benchmark, headline at n = 5, 2000    ~9.5 min
#   bash perf/h200/one_gpu.sh step_kernels $OUT  # the headline, then the decode step's kernels by GPU time at 0 and 64
#                                            # adapters (torch.profiler), this tree and BASE             ~9 min
#   bash perf/h200/one_gpu.sh fuse $OUT      # the fused RoPE + KV write: compiled tests, decode step with it and
#                                            # without, LoRA side stream on / off (one process), profiles,
#                                            # the BGMV shrink sweep                                       ~9 min
#   bash perf/h200/one_gpu.sh fused $OUT     # the tree with the fused RoPE + KV write: its compiled tests and the
#                                            # engine's, decode step with it and without, the headline    ~9 min
#   bash perf/h200/one_gpu.sh gemm $OUT      # the Triton base GEMM (base_gemm=triton): compiled tests, each GEMM
#                                            # against cuBLAS at 1-128 rows, decode step torch / triton (one
#                                            # process), the config sweep at 16 and 128 rows in the time left ~9.5 min
#   bash perf/h200/one_gpu.sh defer $OUT     # the deferred expand (beside the base GEMM, added by the fused
#                                            # consumer): compiled tests, decode step with it and without (one
#                                            # process, profiled), the headline with it                   ~9 min
#   bash perf/h200/one_gpu.sh defer_ab $OUT  # the deferred expand A/B: decode step on / off in interleaved rounds,
#                                            # the headline at n = 5, 100 with it off, on, then off again ~8 min
#   bash perf/h200/one_gpu.sh rounds $OUT    # the older one-process A/Bs re-timed in interleaved rounds (timed one
#                                            # after the other they were not established): LoRA side stream on /
#                                            # off, RoPE + KV write fused / torch, base GEMMs torch / triton ~7 min
#   bash perf/h200/one_gpu.sh order $OUT     # the side-stream shrink captured after its base GEMM: graph tests, decode
#                                            # step before / after x base GEMMs torch / triton, headline  ~8.5 min
#   bash perf/h200/one_gpu.sh auto $OUT      # base_gemm auto: its compiled engine tests, then against torch a
#                                            # shortened headline at n = 100                            ~5 min
#   bash perf/h200/one_gpu.sh auto_ab $OUT   # base_gemm auto against torch: decode step in rounds, the headline at
#                                            # n = 5, 100 with auto, torch, auto                        ~9 min
#   bash perf/h200/one_gpu.sh timeline $OUT  # where the decode step's time goes (base work running / LoRA kernels
#                                            # alone / idle) per variant: side stream x deferred expand, base
#                                            # GEMMs torch / triton; 3 rounds each, profiled               ~5 min
#   bash perf/h200/one_gpu.sh carveout $OUT  # cuBLAS's SM carveout for the LoRA side stream: the base GEMMs alone
#                                            # (cublas / cublaslt x carveout), decode step over blas x carveout
#                                            # x shrink order, 3 rounds                                     ~7 min
#   bash perf/h200/one_gpu.sh carveout_ab $OUT  # the engine's decode-graph GEMM settings: compiled tests, decode step
#                                            # over blas x carveout x order (4 rounds), headline defaults / cuBLAS
#                                            # without carveout at n = 5, 100                               ~9.5 min
#   bash perf/h200/one_gpu.sh carveout_tests $OUT  # every compiled engine test that captures graphs under the new
#                                            # defaults; the default step against cuBLAS, profiled        ~7.5 min
#   bash perf/h200/one_gpu.sh groups $OUT    # per projection group SM carveouts: compiled tests, decode step over
#                                            # GROUP_SPECS in 3 rounds, the fastest against 32 profiled    ~7 min
#   bash perf/h200/one_gpu.sh groups_ab $OUT # the group carveouts as the default: compiled tests, decode step over
#                                            # GROUP_SPECS, headline at n = 5, 100 with them and without ~9.5 min
#   bash perf/h200/one_gpu.sh sanitize $OUT  # compute-sanitizer memcheck over the compiled tests of the segmented
#                                            # decode forms (kernels with device-built tables, no caching
#                                            # allocator; the engine's graph replay and PEFT tests) and of
#                                            # the split-K GEMM                                             ~8 min
#   bash perf/h200/one_gpu.sh race $OUT      # the segmented decode forms' compiled engine tests after the side-stream
#                                            # fix, one process each, side stream on (and off once)       ~4 min
#   bash perf/h200/one_gpu.sh race_ab $OUT   # the sgmv form's engine test against PEFT, BASE (before the fix) and this
#                                            # tree in 2 interleaved rounds, one process each            ~4 min
#   bash perf/h200/one_gpu.sh splits $OUT    # paged attention split over the context: compiled attention tests and
#                                            # the engine's (bgmv, graphs, MoE), the split sweep over batch x
#                                            # context, decode step auto / one pass at batch 1, 8, 16      ~9.5 min
#   bash perf/h200/one_gpu.sh splits_ab $OUT # the headline at n = 5, 100 with the attention splits chosen (auto),
#                                            # then with one pass (MANYLORA_ATTENTION_SPLITS=1)            ~5 min
#   bash perf/h200/one_gpu.sh splits_long $OUT # long prompts at a low rate (4-8K tokens in, 128-256 out, 1 req/s):
#                                            # the headline's engine with the splits, then with one pass  ~5 min
#   bash perf/h200/one_gpu.sh server $OUT    # tritonserver: TTFT at 50/90% of SATURATION, perf_analyzer at
#                                            # concurrency 16 and request rates PA_RATES                    ~8 min
# DECODE_LORA (bgmv|sgmv) and PREFILL (sdpa|paged) pick the engine's kernels in the headline part.
set -u
PART=${1:?part: kernels, forms, expand, rows, rows_ab, step_kernels, fuse, fused, gemm, defer, defer_ab, rounds, order, auto, auto_ab, timeline, carveout, carveout_ab, carveout_tests, groups, groups_ab, race, race_ab, sanitize, splits, splits_ab, splits_long, headline, mixed, final, profile or server}
OUT=${2:-/tmp/h200}
ROOT=$PWD
BASE=${BASE:-$ROOT/.baseline_s9}
W=/tmp/one_$PART
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
T0=$(date +%s)
stamp() { echo "$1 rc=$2 at $(($(date +%s) - T0)) s" >> "$W/times.txt"; }
# time_left [BUDGET_S [AT_LEAST_S]]: seconds left of the part's BUDGET_S (570) since it began, at least AT_LEAST_S
# (30): the timeout of a part's last step
time_left() {
  local left=$((${1:-570} - ($(date +%s) - T0)))
  echo $((left > ${2:-30} ? left : ${2:-30}))
}
# headline NAME TIMEOUT_S ARGS...: perf.headline on the headline's workload (S-LoRA's, 288 requests offered at
# 24 req/s for 12 s, then drained) into $W/NAME, its log $W/NAME.txt; ARGS add --adapters and any engine options
headline() {
  local name=$1 limit=$2
  shift 2
  mkdir -p "$W/work"
  PYTHONPATH=$ROOT timeout "$limit" python3 -m perf.headline --shape llama3-8b --out "$W/$name" --workdir "$W/work" \
    --rate 24 --duration 12 --drain 15 --skip-peft --max-num-seqs 128 --admit-every-steps 4 "$@" > "$W/$name.txt" 2>&1
}
# decode_steps LIMIT_S ARGS...: perf.bench_decode_step ARGS of this tree, then of BASE, each under LIMIT_S, into
# $W/step_{new,base}/ with logs $W/step_{new,base}.txt
decode_steps() {
  local limit=$1
  shift
  PYTHONPATH=$ROOT timeout "$limit" python3 -m perf.bench_decode_step "$@" --out "$W/step_new" > "$W/step_new.txt" 2>&1
  stamp "decode step new" $?
  (cd "$BASE" && PYTHONPATH=$BASE timeout "$limit" python3 -m perf.bench_decode_step "$@" --out "$W/step_base") \
    > "$W/step_base.txt" 2>&1
  stamp "decode step baseline" $?
}
# kernels_quick LIMIT_S: this tree's kernel benchmark (BGMV, rank 16) into $W/kernels_new.jsonl
kernels_quick() {
  PYTHONPATH=$ROOT timeout "$1" python3 perf/bench_kernels.py --quick --rep-ms 5 --out "$W/kernels_new.jsonl" \
    > "$W/kernels_new.txt" 2>&1
  stamp "bench_kernels new" $?
}
# step_lines [EXTRA_REGEX]: the decode-step tables (and EXTRA_REGEX lines) of this tree and BASE, for a summary
step_lines() {
  for t in new base; do
    echo "== decode step $t"
    grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth${1:+|$1}" "$W/step_$t.txt" | cut -c1-160
  done
}
# compiled_tests LIMIT PYTEST_ARGS...: the kernel tests compiled on the GPU (TRITON_INTERPRET=0) under LIMIT_S, into
# $W/gpu_tests.txt, stamped
compiled_tests() {
  local limit=$1
  shift
  PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" \
    > "$W/gpu_tests.txt" 2>&1
  stamp "compiled tests" $?
}
# summary_head: the GPU, the steps' exit codes and times, and the compiled tests' outcome, for a part's summary
summary_head() {
  cat "$W/gpu.txt" "$W/times.txt"
  if [ -f "$W/gpu_tests.txt" ]; then
    echo "== compiled tests"; grep -E "passed|failed|FAILED|rror" "$W/gpu_tests.txt" | tail -n 8
  fi
}
# headline_lines [DIR]: the headline table rows and ratios of $W/DIR (default headline)
headline_lines() {
  echo "== ${1:-headline}"; grep -E "^\| engine|ratio" "$W/${1:-headline}/summary.md" | head -20
}
# ab_summary HEADLINE...: a decode-step-and-headline A/B part's summary: summary_head, $W/step.txt's table, then each
# HEADLINE's rows where it ran
ab_summary() {
  summary_head
  echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
  for h in "$@"; do [ -f "$W/$h/summary.md" ] && headline_lines "$h"; done
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$W/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$W/gpu.txt" 2>&1

case "$PART" in
kernels)
  compiled_tests 200 \
    tests/kernels/test_lora_kernels.py tests/kernels/test_lora_segments.py tests/kernels/test_lora_batch.py \
    tests/kernels/test_engine_kernels.py
  PYTHONPATH=$ROOT timeout 130 python3 -m perf.bench_decode_step --decode-lora-kernels bgmv,sgmv \
    --out "$W/step_new" > "$W/step_new.txt" 2>&1
  stamp "decode step new (bgmv, sgmv)" $?
  (cd "$BASE" && PYTHONPATH=$BASE timeout 80 python3 -m perf.bench_decode_step --out "$W/step_base") \
    > "$W/step_base.txt" 2>&1
  stamp "decode step baseline" $?
  PYTHONPATH=$ROOT timeout $(time_left) python3 perf/bench_kernels.py --quick \
    --forms bgmv,sgmv-device --rep-ms 5 --out "$W/kernels_new.jsonl" > "$W/kernels_new.txt" 2>&1
  stamp "bench_kernels new" $?
  {
    summary_head
    for s in new base; do echo "== decode step $s"; grep -E "^ *[0-9]+ +[0-9.]+ |^LoRA kernels|copy" "$W/step_$s.txt"; done
    echo "== LoRA kernels at decode sizes: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" --tokens 16 64
  } > "$OUT/kernels.txt" 2>&1
  ;;
forms)
  # the decode-step LoRA forms: compiled tests of the segmented ones (the gate), the decode step of each form in one
  # process, the headline with the fastest form whose tests passed, and the kernel benchmark of this tree and BASE
  PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q \
    -p no:cacheprovider tests/kernels/test_engine_kernels.py tests/kernels/test_lora_kernels.py \
    tests/kernels/test_lora_segments.py tests/kernels/test_lora_batch.py \
    -k "sgmv or hybrid or device_segments or warm_up or no_host_data" > "$W/gpu_tests.txt" 2>&1
  stamp "compiled tests" $?
  PYTHONPATH=$ROOT timeout 150 python3 -m perf.bench_decode_step \
    --decode-lora-kernels bgmv,sgmv,hybrid \
    --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step bgmv, sgmv, hybrid" $?
  FORM=$(python3 - "$W" <<'EOF2'
import json, re, sys
w = sys.argv[1]
tests = open(f"{w}/gpu_tests.txt").read()
failed = set(re.findall(r"FAILED \S*(sgmv|hybrid)", tests))
try:
    rows = json.load(open(f"{w}/step/decode_step.json"))["rows"]
except (OSError, ValueError, KeyError):
    print("bgmv"); sys.exit()
mean = {}
for r in rows:
    if r["adapters"] > 0:
        mean.setdefault(r["lora_kernels"], []).append(r["step_ms"])
ok = {f: sum(v) / len(v) for f, v in mean.items() if f not in failed and ("passed" in tests or f == "bgmv")}
print(min(ok, key=ok.get) if ok else "bgmv")
EOF2
)
  echo "headline form: $FORM" >> "$W/times.txt"
  headline headline $(time_left 520 60) --adapters 5 100 1000 2000 \
    --decode-lora-kernels "$FORM"
  stamp "headline ($FORM)" $?
  rm -rf "$W/work"
  PYTHONPATH=$ROOT timeout 30 python3 perf/bench_kernels.py --quick --forms bgmv,sgmv-device --rep-ms 5 \
    --out "$W/kernels_new.jsonl" > "$W/kernels_new.txt" 2>&1
  stamp "bench_kernels new" $?
  (cd "$BASE" && PYTHONPATH=$BASE timeout 30 python3 perf/bench_kernels.py --quick --rep-ms 5 \
    --out "$W/kernels_base.jsonl") > "$W/kernels_base.txt" 2>&1
  stamp "bench_kernels baseline" $?
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    headline_lines
    echo "== LoRA kernels T=64, this tree and BASE: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" "base=$W/kernels_base.jsonl" --tokens 64
  } > "$OUT/forms.txt" 2>&1
  ;;
expand)
  # the BGMV expand with its 16-byte paths off (BGMV_EXPAND_VECTOR): compiled tests of the BGMV paths, the decode step
  # of this tree and of BASE, the kernel benchmark, then the headline
  compiled_tests 200 -x \
    tests/kernels/test_lora_kernels.py tests/kernels/test_lora_segments.py tests/kernels/test_lora_batch.py tests/kernels/test_engine_kernels.py \
    -k "not sgmv and not hybrid"
  decode_steps 100
  kernels_quick 40
  headline headline $(time_left 570 60) --adapters 5 100 1000 2000
  stamp "headline" $?
  rm -rf "$W/work"
  {
    summary_head
    step_lines
    headline_lines
    echo "== LoRA kernels, bgmv, T = 16 / 64: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" --tokens 16 64
  } > "$OUT/expand.txt" 2>&1
  ;;
rows)
  # the BGMV expand streaming B^T row by row (manylora/kernels/lora_expand.py bgmv_expand_rows): compiled tests of the BGMV
  # paths and the graphs, the expand sweep (the old tile body and the rows body in one process), the decode step of
  # this tree and of BASE, the kernel benchmark
  compiled_tests 240 \
    tests/kernels/test_lora_kernels.py tests/kernels/test_engine_kernels.py tests/kernels/test_step_graphs.py \
    tests/kernels/test_decode_graph_forms.py -k "not sgmv and not hybrid"
  PYTHONPATH=$ROOT timeout 120 python3 perf/bench_kernels.py --sweep-expand --sweep-only --rep-ms 5 \
    --out "$W/expand_sweep.jsonl" > "$W/expand_sweep.txt" 2>&1
  stamp "expand sweep" $?
  decode_steps 100
  kernels_quick $(time_left 575 20)
  {
    summary_head
    echo "== expand sweep"; grep -E "T= *[0-9]+ d=" "$W/expand_sweep.txt" | cut -c1-230
    step_lines
    echo "== LoRA kernels, bgmv, T = 16 / 64: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" --tokens 16 64
  } > "$OUT/rows.txt" 2>&1
  ;;
rows_ab)
  # the BGMV expand's heuristic (tile body for small launches, row-streaming body for the rest): compiled tests
  # (kernel grid, the engine against PEFT, mixed-step graphs), the decode step of this tree and BASE, the kernel
  # benchmark, then the headline at n = 5 and 2000 in what time is left
  compiled_tests 150 \
    tests/kernels/test_lora_kernels.py tests/kernels/test_engine_kernels.py tests/kernels/test_step_graphs.py \
    -k "grid or rows or aligned or (llama-sdpa-True-bgmv) or (replay_equals_eager and bgmv) or mixed_steps"
  decode_steps 140
  kernels_quick 40
  headline headline $(time_left 580) --adapters 5 2000
  stamp "headline n = 5, 2000" $?
  rm -rf "$W/work"
  {
    summary_head
    step_lines
    headline_lines
    echo "== LoRA kernels, bgmv, T = 16 / 64: us (x floor) [vs bmm]"
    python3 perf/kernel_table.py "new=$W/kernels_new.jsonl" --tokens 16 64
  } > "$OUT/rows_ab.txt" 2>&1
  ;;
step_kernels)
  headline headline 250 --adapters 5 100 1000 2000
  stamp "headline" $?
  rm -rf "$W/work"
  decode_steps 120 --adapters 0,64 --profile
  {
    summary_head
    headline_lines
    step_lines "^--|^  +[0-9.]+ ms"
  } > "$OUT/step_kernels.txt" 2>&1
  ;;
fuse)
  compiled_tests 170 \
    tests/kernels/test_rope_kv.py tests/kernels/test_lora_kernels.py tests/kernels/test_engine_kernels.py \
    tests/kernels/test_step_graphs.py -k "not sgmv and not hybrid"
  PYTHONPATH=$ROOT timeout 190 python3 -m perf.bench_decode_step --rope-kv fused,torch --lora-side-stream on,off \
    --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: rope+kv fused / torch x side stream on / off" $?
  PYTHONPATH=$ROOT timeout 100 python3 -m perf.bench_decode_step --rope-kv fused,torch --adapters 0,64 --profile \
    --out "$W/step_profile" > "$W/step_profile.txt" 2>&1
  stamp "decode step profiles" $?
  PYTHONPATH=$ROOT timeout $(time_left 575) python3 perf/bench_kernels.py --sweep --sweep-only --rep-ms 5 \
    --out "$W/shrink_sweep.jsonl" > "$W/shrink_sweep.txt" 2>&1
  stamp "shrink sweep" $?
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    echo "== profiles"; grep -E "^--|^  +[0-9.]+ ms" "$W/step_profile.txt" | cut -c1-110
    echo "== shrink sweep"; grep -E "T=" "$W/shrink_sweep.txt" | cut -c1-200
  } > "$OUT/fuse.txt" 2>&1
  ;;
fused)
  compiled_tests 170 \
    tests/kernels/test_rope_kv.py tests/kernels/test_engine_kernels.py tests/kernels/test_step_graphs.py \
    -k "rope or (llama-sdpa-True-bgmv) or (qwen3-sdpa-True-bgmv) or (mistral-paged-True-bgmv) \
    or (replay_equals_eager and bgmv) or mixed_steps"
  PYTHONPATH=$ROOT timeout 120 python3 -m perf.bench_decode_step --rope-kv fused,torch --out "$W/step" \
    > "$W/step.txt" 2>&1
  stamp "decode step: rope+kv fused / torch" $?
  headline headline $(time_left) --adapters 5 100 1000 2000
  stamp "headline" $?
  rm -rf "$W/work"
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    headline_lines
  } > "$OUT/fused.txt" 2>&1
  ;;
gemm)
  compiled_tests 150 tests/kernels/test_skinny_gemm.py tests/kernels/test_engine_kernels.py \
    -k "skinny or triton_base_gemm or (llama-sdpa-True-bgmv) or (replay_equals_eager and bgmv)"
  PYTHONPATH=$ROOT timeout 100 python3 -m perf.bench_gemm --out "$W/gemm.jsonl" > "$W/gemm.txt" 2>&1
  stamp "GEMMs: triton / cuBLAS" $?
  PYTHONPATH=$ROOT timeout 150 python3 -m perf.bench_decode_step --base-gemm torch,triton \
    --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: base GEMMs torch / triton" $?
  # the sweep last, in the time left (18_gemm swept 64 rows of q/k/v and o): each record is printed as it is done
  PYTHONPATH=$ROOT timeout $(time_left) python3 -m perf.bench_gemm --rows 16,128 \
    --shapes qkv,o,down,gate_up --sweep --rep-ms 3 --out "$W/gemm_sweep.jsonl" > "$W/gemm_sweep.txt" 2>&1
  stamp "GEMM sweep" $?
  {
    summary_head
    echo "== GEMMs"; sed -n '/^shape /,/^$/p' "$W/gemm.txt"
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    echo "== GEMM sweep"; sed -n '/^shape /,/^$/p' "$W/gemm_sweep.txt"; grep -o '"best_config": {[^}]*}' \
      "$W/gemm_sweep.txt"
  } > "$OUT/gemm.txt" 2>&1
  ;;
defer)
  compiled_tests 170 \
    tests/kernels/test_lora_kernels.py tests/kernels/test_rope_kv.py tests/kernels/test_silu_mul.py \
    tests/kernels/test_add_rms_norm.py tests/kernels/test_engine_kernels.py tests/kernels/test_step_graphs.py \
    -k "overwrite or argument_errors or lora_term or deferred or (llama-sdpa-True-bgmv) or (qwen3-sdpa-True-bgmv) \
    or (replay_equals_eager and bgmv) or mixed_steps"
  PYTHONPATH=$ROOT timeout 160 python3 -m perf.bench_decode_step --defer-expand on,off --profile --out "$W/step" \
    > "$W/step.txt" 2>&1
  stamp "decode step: deferred expand on / off" $?
  headline headline $(time_left) --adapters 5 100 1000 2000
  stamp "headline" $?
  rm -rf "$W/work"
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    echo "== decode step kernels (top 6 of each)"; grep -A6 -E "^-- .*(8|64) adapters" "$W/step.txt" | cut -c1-110
    headline_lines
  } > "$OUT/defer.txt" 2>&1
  ;;
defer_ab)
  PYTHONPATH=$ROOT timeout 170 python3 -m perf.bench_decode_step --defer-expand on,off --rounds 3 --out "$W/step" \
    > "$W/step.txt" 2>&1
  stamp "decode step: deferred expand on / off, 3 rounds" $?
  MANYLORA_LORA_DEFER_EXPAND=0 headline headline_off 130 --adapters 5 100
  stamp "headline, deferred expand off" $?
  headline headline_on 130 --adapters 5 100
  stamp "headline, deferred expand on" $?
  left=$((570 - ($(date +%s) - T0)))
  if [ "$left" -gt 90 ]; then
    MANYLORA_LORA_DEFER_EXPAND=0 headline headline_off2 "$left" --adapters 5 100
    stamp "headline, deferred expand off again" $?
  fi
  rm -rf "$W/work"
  ab_summary headline_off headline_on headline_off2 > "$OUT/defer_ab.txt" 2>&1
  ;;
rounds)
  for ab in "lora-side-stream on,off" "rope-kv fused,torch" "base-gemm torch,triton"; do
    read -r flag values <<< "$ab"
    PYTHONPATH=$ROOT timeout 150 python3 -m perf.bench_decode_step "--$flag" "$values" --rounds 3 \
      --out "$W/step_$flag" > "$W/step_$flag.txt" 2>&1
    stamp "decode step: --$flag $values, 3 rounds" $?
  done
  {
    summary_head
    for f in "$W"/step_*.txt; do
      echo "== $(basename "$f" .txt)"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$f" | cut -c1-200
    done
  } > "$OUT/rounds.txt" 2>&1
  ;;
order)
  # the side-stream shrink captured after its base GEMM (LoraBatch.fork, MANYLORA_LORA_SHRINK_AFTER_GEMM=1): the
  # engine's graph tests with it, decode step before / after x base GEMMs torch / triton in 3 rounds (profiled
  # after), the headline at n = 5, 100 with it, then without
  MANYLORA_LORA_SHRINK_AFTER_GEMM=1 compiled_tests 110 tests/kernels/test_engine_kernels.py \
    tests/kernels/test_step_graphs.py -k "(replay_equals_eager and bgmv) or mixed_steps or deferred"
  PYTHONPATH=$ROOT timeout 180 python3 -m perf.bench_decode_step --shrink-order before,after \
    --base-gemm torch,triton --rounds 3 --profile --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: shrink before / after the GEMM x base GEMMs torch / triton, 3 rounds, profiled" $?
  MANYLORA_LORA_SHRINK_AFTER_GEMM=1 headline headline_after 110 --adapters 5 100
  stamp "headline, shrink after the GEMM" $?
  headline headline_before "$(time_left 520 60)" --adapters 5 100
  stamp "headline, shrink before the GEMM" $?
  rm -rf "$W/work"
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth|^-- |per step:|waited" "$W/step.txt" | cut -c1-200
    for h in headline_after headline_before; do [ -f "$W/$h/summary.md" ] && headline_lines "$h"; done
  } > "$OUT/order.txt" 2>&1
  ;;
auto)
  # base_gemm "auto" (the Triton GEMM with the shrink after it in captured LoRA steps of <= 64 tokens, cuBLAS
  # elsewhere) against the default, end to end: the headline's workload at n = 100, shortened to 8 s of arrivals
  # (192 requests), with it, then without; first the compiled engine tests of auto (PEFT oracle; the captured LoRA
  # steps must take the split-K kernel) and of graph replay
  compiled_tests 150 tests/kernels/test_engine_kernels.py tests/test_base_gemm_choice.py \
    -k "auto or (replay_equals_eager and bgmv) or base_gemm"
  for g in auto torch; do
    mkdir -p "$W/work"
    PYTHONPATH=$ROOT timeout 120 python3 -m perf.headline --shape llama3-8b --out "$W/headline_$g" --workdir "$W/work" \
      --rate 24 --duration 8 --drain 10 --skip-peft --max-num-seqs 128 --admit-every-steps 4 --adapters 100 \
      --base-gemm "$g" > "$W/headline_$g.txt" 2>&1
    stamp "headline (8 s of arrivals), base_gemm $g" $?
  done
  rm -rf "$W/work"
  { summary_head; for h in headline_auto headline_torch; do [ -f "$W/$h/summary.md" ] && headline_lines "$h"; done
  } > "$OUT/auto.txt" 2>&1
  ;;
auto_ab)
  # base_gemm auto against torch: the decode step in 3 interleaved rounds, then the headline's workload at n = 5, 100
  # with auto, torch, then auto again (a drift check). The step's limit covers the split-K GEMM's first compilation
  # (120 s did not, 27_auto_ab); the headlines took 98-115 s there
  PYTHONPATH=$ROOT timeout 200 python3 -m perf.bench_decode_step --adapters 0,8,64 --base-gemm torch,auto \
    --rounds 3 --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: base GEMMs torch / auto, 3 rounds" $?
  headline headline_auto 125 --adapters 5 100 --base-gemm auto
  stamp "headline, base_gemm auto" $?
  headline headline_torch 125 --adapters 5 100 --base-gemm torch
  stamp "headline, base_gemm torch" $?
  headline headline_auto2 "$(time_left 560 60)" --adapters 5 100 --base-gemm auto
  stamp "headline, base_gemm auto (again)" $?
  rm -rf "$W/work"
  ab_summary headline_auto headline_torch headline_auto2 > "$OUT/auto_ab.txt" 2>&1
  ;;
timeline)
  # where the captured decode step's time goes (perf/stream_timeline.py, from each profile): base work running, LoRA
  # kernels alone, nothing running; the side stream off twice (deferral needs it: the two are one graph, a drift
  # check); then the base GEMMs torch / triton, profiled too
  PYTHONPATH=$ROOT timeout 240 python3 -m perf.bench_decode_step --adapters 0,8,64 --lora-side-stream on,off \
    --defer-expand on,off --rounds 3 --profile --out "$W/step_streams" > "$W/step_streams.txt" 2>&1
  stamp "decode step: side stream on / off x deferred expand on / off, 3 rounds, profiled" $?
  PYTHONPATH=$ROOT timeout "$(time_left 540 60)" python3 -m perf.bench_decode_step --adapters 0,8,64 \
    --base-gemm torch,triton --rounds 3 --profile --out "$W/step_gemm" > "$W/step_gemm.txt" 2>&1
  stamp "decode step: base GEMMs torch / triton, 3 rounds, profiled" $?
  {
    summary_head
    for f in "$W"/step_streams.txt "$W"/step_gemm.txt; do
      echo "== $(basename "$f" .txt)"
      grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth|^-- |per step:|waited" "$f" | cut -c1-200
    done
  } > "$OUT/timeline.txt" 2>&1
  ;;
carveout)
  # cuBLAS's SM carveout (torch._C._set_sm_carveout_experimental: the base GEMMs target fewer SMs, leaving the rest
  # to the LoRA side stream's kernels): each base GEMM at 64 rows alone, F.linear through cublas / cublaslt x
  # carveout none / 16 / 32; then the decode step over blas x carveout none / 8 / 16 / 32 x shrink captured before /
  # after its GEMM, 3 interleaved rounds
  for blas in cublas cublaslt; do
    for c in none 16 32; do
      extra=()
      [ "$c" != none ] && extra=(--sm-carveout "$c")
      PYTHONPATH=$ROOT timeout 60 python3 perf/bench_gemm.py --rows 64 --shapes qkv,o,gate_up,down --blas "$blas" \
        "${extra[@]}" --out "$W/gemm_${blas}_$c.jsonl" > "$W/gemm_${blas}_$c.txt" 2>&1
      stamp "GEMMs at 64 rows, $blas, carveout $c" $?
    done
  done
  PYTHONPATH=$ROOT timeout "$(time_left 570 60)" python3 -m perf.bench_decode_step --blas cublas,cublaslt \
    --sm-carveout none,8,16,32 --shrink-order before,after --rounds 3 --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: blas x SM carveout x shrink order, 3 rounds" $?
  PYTHONPATH=$ROOT timeout "$(time_left 585 20)" python3 -m perf.bench_decode_step --adapters 8,64 \
    --blas "${PROFILE_BLAS:-cublaslt}" --sm-carveout none,"${PROFILE_CARVEOUT:-16}" --shrink-order after --rounds 1 \
    --profile --out "$W/step_profile" > "$W/step_profile.txt" 2>&1
  stamp "decode step profiled, carveout none / ${PROFILE_CARVEOUT:-16}" $?
  {
    summary_head
    for f in "$W"/gemm_*.txt; do
      echo "== $(basename "$f" .txt)"; grep -E "^(qkv|o|gate_up|down) " "$f"
    done
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-220
    echo "== profiled"; grep -E "^ *[0-9]+ +[0-9.]+ |^-- |per step:|waited|gemm|nvjet|sm90|cutlass" "$W/step_profile.txt" | cut -c1-220
  } > "$OUT/carveout.txt" 2>&1
  ;;
carveout_ab)
  # the decode graphs' GEMM settings (EngineConfig.decode_gemm_blas / decode_gemm_sm_carveout, manylora/engine/layers/decode_gemms.py)
  # as the engine applies them: their compiled tests (graph replay equal to eager with and without the carveout, the
  # engine against PEFT), the decode step over cublas / cublaslt x carveout 0 / 32 / 48 / 64 x shrink order in 4
  # interleaved rounds, then the headline at n = 5, 100 with the defaults and with cuBLAS without a carveout
  compiled_tests 150 tests/test_decode_gemms.py tests/kernels/test_engine_kernels.py \
    -k "decode_gemms or (replay_equals_eager and bgmv) or llama-sdpa-True-bgmv"
  PYTHONPATH=$ROOT timeout 200 python3 -m perf.bench_decode_step --blas cublas,cublaslt --sm-carveout 0,32,48,64 \
    --shrink-order before,after --rounds 4 --out "$W/step" > "$W/step.txt" 2>&1
  stamp "decode step: blas x SM carveout x shrink order, 4 rounds" $?
  headline headline_default 115 --adapters 5 100
  stamp "headline, cuBLASLt + carveout 32 (the defaults)" $?
  headline headline_cublas "$(time_left 570 60)" --adapters 5 100 --decode-gemm-blas cublas --decode-gemm-sm-carveout 0
  stamp "headline, cuBLAS, no carveout" $?
  rm -rf "$W/work"
  ab_summary headline_default headline_cublas > "$OUT/carveout_ab.txt" 2>&1
  ;;
groups)
  # per projection group SM carveouts (EngineConfig.decode_gemm_group_carveouts): their compiled tests, the decode
  # step over several group counts in interleaved rounds, then the fastest against the default, profiled
  compiled_tests 150 tests/test_decode_gemms.py tests/kernels/test_engine_kernels.py -k "carveout or (replay_equals and bgmv)"
  PYTHONPATH=$ROOT timeout 240 python3 -m perf.bench_decode_step --rounds 3 --out "$W/step" \
    --sm-carveout "${GROUP_SPECS:-32,32/gate_up=16,32/gate_up=8,32/qkv=48/gate_up=16,32/qkv=64/gate_up=16,32/qkv=48}" \
    > "$W/step.txt" 2>&1
  stamp "decode step over group carveouts, 3 rounds" $?
  BEST=$(python3 - "$W" <<'EOF2'
import json, statistics, sys
rows = json.load(open(f"{sys.argv[1]}/step/decode_step.json"))["rows"]
mean = {}
for r in rows:
    if r["adapters"]:
        mean.setdefault(r["sm_carveout"], []).append(r["step_ms"])
print(min(mean, key=lambda k: statistics.mean(mean[k])))
EOF2
)
  echo "fastest: $BEST" >> "$W/times.txt"
  PYTHONPATH=$ROOT timeout "$(time_left 560 40)" python3 -m perf.bench_decode_step --adapters 8,64 --rounds 2 \
    --sm-carveout "32,$BEST" --profile --out "$W/step_profile" > "$W/step_profile.txt" 2>&1
  stamp "decode step 32 / $BEST, profiled" $?
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/step.txt" | cut -c1-200
    echo "== profiled"; grep -E "^ *[0-9]+ +[0-9.]+ |^-- |per step:|waited|nvjet" "$W/step_profile.txt" | cut -c1-200
  } > "$OUT/groups.txt" 2>&1
  ;;
groups_ab)
  # the per projection group carveouts as the engine's default (then qkv=64/gate_up=16 beside 32): compiled tests (graph
  # replay equal to eager, the engine against PEFT, the settings), the decode step over GROUP_SPECS in 3 interleaved
  # rounds, then the headline at n = 5, 100 with the default and with 32 SMs for every GEMM
  compiled_tests 150 tests/test_decode_gemms.py tests/kernels/test_engine_kernels.py \
    -k "decode_gemms or (replay_equals_eager and bgmv) or llama-sdpa-True-bgmv"
  PYTHONPATH=$ROOT timeout 200 python3 -m perf.bench_decode_step --rounds 3 --out "$W/step" \
    --sm-carveout "${GROUP_SPECS:-32,32/qkv=64,32/qkv=80,32/qkv=64/gate_up=16,32/qkv=64/gate_up=24,32/qkv=64/o=48/down=48}" \
    > "$W/step.txt" 2>&1
  stamp "decode step over group carveouts, 3 rounds" $?
  headline headline_groups 110 --adapters 5 100
  stamp "headline, group carveouts (the defaults)" $?
  headline headline_32 "$(time_left 570 60)" --adapters 5 100 --decode-gemm-group-carveouts ""
  stamp "headline, 32 SMs for every GEMM" $?
  rm -rf "$W/work" "$W"/headline_*/*.jsonl
  ab_summary headline_groups headline_32 > "$OUT/groups_ab.txt" 2>&1
  ;;
carveout_tests)
  # after the decode graphs' defaults changed (cuBLASLt, 32 SMs left to the LoRA side stream): every compiled engine
  # test that captures graphs (dense, MoE, mixed steps, warm-up) and the settings' own; then the default decode step
  # against cuBLAS without a carveout, profiled (where the step's time goes)
  compiled_tests 250 tests/test_decode_gemms.py tests/kernels/test_engine_kernels.py tests/kernels/test_step_graphs.py \
    tests/kernels/test_moe_graph_mode.py
  PYTHONPATH=$ROOT timeout "$(time_left 450 60)" python3 -m perf.bench_decode_step --adapters 8,64 \
    --blas cublas,cublaslt --sm-carveout 0,32 --shrink-order after --rounds 2 --profile --out "$W/step" \
    > "$W/step.txt" 2>&1
  stamp "decode step: cuBLAS / cuBLASLt + carveout 32, profiled" $?
  {
    summary_head
    echo "== decode step"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth|^-- |per step:|waited" "$W/step.txt" | cut -c1-220
  } > "$OUT/carveout_tests.txt" 2>&1
  ;;
race)
  # the segmented decode forms after the side-stream fix (b26b390): each of their compiled engine tests in its own
  # process (an illegal access kills the context, failing every later test of a process), side stream on, then the
  # first again with it off; a pass on is what lifting their refusal on CUDA needs (then `forms` times them)
  forms_test() {
    local name=$1 side=$2
    shift 2
    MANYLORA_LORA_SIDE_STREAM=$side PYTHONPATH=$ROOT TRITON_INTERPRET=0 \
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py -k "$*" \
      > "$W/$name.txt" 2>&1
    stamp "$name (side stream $side)" $?
  }
  forms_test sgmv_peft 1 "kernel_path_matches_peft and sgmv"
  forms_test hybrid_peft 1 "kernel_path_matches_peft and hybrid"
  forms_test sgmv_replay 1 "replay_equals_eager and sgmv"
  forms_test hybrid_replay 1 "replay_equals_eager and hybrid"
  forms_test sgmv_peft_side_off 0 "kernel_path_matches_peft and sgmv"
  {
    summary_head
    for name in sgmv_peft hybrid_peft sgmv_replay hybrid_replay sgmv_peft_side_off; do
      echo "== $name"; grep -E "passed|failed|illegal" "$W/$name.txt" | head -3
    done
  } > "$OUT/race.txt" 2>&1
  ;;
race_ab)
  # the side-stream fix as an A/B on one machine: the sgmv form's compiled engine test against PEFT (side stream on),
  # BASE (the tree before the fix, e.g. `git archive 21214a0 backend kernels perf tests | tar -x -C .baseline`) and
  # this tree in 2 interleaved rounds, one process each (an illegal access kills the process's context)
  race_test() {
    local name=$1 tree=$2
    (cd "$tree" && MANYLORA_LORA_SIDE_STREAM=1 PYTHONPATH=$tree \
      TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_kernels.py \
      -k "kernel_path_matches_peft and sgmv") > "$W/$name.txt" 2>&1
    stamp "$name" $?
  }
  for round in 1 2; do
    race_test "base_$round" "$BASE"
    race_test "new_$round" "$ROOT"
  done
  {
    summary_head
    for name in base_1 new_1 base_2 new_2; do
      echo "== $name"; grep -E "passed|failed|illegal" "$W/$name.txt" | head -3
    done
  } > "$OUT/race_ab.txt" 2>&1
  ;;
sanitize)
  # the segmented decode forms' illegal memory access (their compiled engine tests, 2026-11-30): where it is.
  # Without the caching allocator every tensor is its own allocation, so memcheck sees an access past any of them
  # (CUDA graphs need the allocator: the engine's tests run with it). Under memcheck, which runs kernels one at a time,
  # the access did not occur (28_sanitize): a race, found with the side stream off (29_side_stream_race; `race`)
  sanitizer() {
    local tool=$1 name=$2 limit=$3
    shift 3
    PYTHONPATH=$ROOT TRITON_INTERPRET=0 timeout "$limit" compute-sanitizer \
      --tool "$tool" --print-limit 8 --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider "$@" \
      > "$W/$name.txt" 2>&1
    stamp "$tool $name" $?
  }
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 sanitizer memcheck lora_kernels 140 tests/kernels/test_lora_kernels.py \
    -k "(grid and (64-130 or 17-72)) or cuda_graph_sizes"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 sanitizer memcheck skinny_gemm 50 tests/kernels/test_skinny_gemm.py -k "matches"
  sanitizer memcheck engine_graphs 220 tests/kernels/test_engine_kernels.py -k "replay_equals_eager and (sgmv or hybrid)"
  # the engine tests against PEFT capture graphs too, which fail without the caching allocator (28_sanitize): with it
  sanitizer memcheck engine_peft 130 tests/kernels/test_engine_kernels.py \
    -k "kernel_path_matches_peft and (sgmv or hybrid)"
  {
    summary_head
    for name in lora_kernels skinny_gemm engine_graphs engine_peft; do
      echo "== $name"
      grep -E "ERROR SUMMARY|Invalid|Uninitialized|Address 0x|is out of bounds|by thread|at 0x|passed|failed" \
        "$W/$name.txt" | head -24
    done
  } > "$OUT/sanitize.txt" 2>&1
  ;;
splits)
  # flash-decoding splits of the paged attention (manylora/kernels/paged_attention.py attention_splits): the kernel's compiled
  # tests and the engine's that decode at small batches (every split path against PEFT and graph replay), the sweep
  # of split counts over batch x context, then the whole decode step with the splits chosen (auto) and with one pass
  # (1), captured in one process and timed in interleaved rounds, at small batches and long contexts
  compiled_tests 200 tests/kernels/test_paged_attention.py tests/kernels/test_engine_kernels.py \
    -k "not engine_kernels or (kernel_path_matches_peft and bgmv) or (replay_equals_eager and bgmv) or moe_cuda_graph or warm_up"
  PYTHONPATH=$ROOT timeout 170 python3 -m perf.bench_attention --out "$W/attention.jsonl" > "$W/attention.txt" 2>&1
  stamp "attention splits sweep" $?
  split_step() {
    local name=$1 limit=$2
    shift 2
    PYTHONPATH=$ROOT timeout "$limit" python3 -m perf.bench_decode_step --attention-splits auto,1 --rounds 3 \
      --out "$W/$name" "$@" > "$W/$name.txt" 2>&1
    stamp "decode step $name" $?
  }
  split_step step_b1 90 --batch 1 --context 8192 --adapters 0,1
  split_step step_b8 90 --batch 8 --context 4096 --adapters 0,8
  split_step step_b16 "$(time_left 565)" --batch 16 --context 2048 --adapters 0,16
  {
    summary_head
    echo "== attention splits"; sed -n '/^batch /,/^$/p' "$W/attention.txt"; grep -E "SMs|copy bandwidth" "$W/attention.txt"
    for name in step_b1 step_b8 step_b16; do
      echo "== decode step $name"; grep -E "^ *[0-9]+ +[0-9.]+ |copy_bandwidth" "$W/$name.txt" | cut -c1-220
    done
  } > "$OUT/splits.txt" 2>&1
  ;;
splits_ab)
  headline headline_auto 200 --adapters 5 100
  stamp "headline, attention splits auto" $?
  MANYLORA_ATTENTION_SPLITS=1 headline headline_one_pass "$(time_left 450 60)" --adapters 5 100
  stamp "headline, attention one pass" $?
  rm -rf "$W/work"
  { summary_head; headline_lines headline_auto; headline_lines headline_one_pass; } > "$OUT/splits_ab.txt" 2>&1
  ;;
splits_long)
  # few sequences with long contexts, where the one-pass attention leaves the GPU idle: later arguments override the
  # headline function's rate and drain
  long=(--adapters 5 --input-range 4096 8192 --output-range 128 256 --rate 1 --duration 12 --drain 45)
  headline long_auto 200 "${long[@]}"
  stamp "long prompts, attention splits auto" $?
  MANYLORA_ATTENTION_SPLITS=1 headline long_one_pass "$(time_left 450 60)" "${long[@]}"
  stamp "long prompts, attention one pass" $?
  rm -rf "$W/work"
  { summary_head; headline_lines long_auto; headline_lines long_one_pass; } > "$OUT/splits_long.txt" 2>&1
  ;;
headline)
  headline headline 330 --adapters 5 100 1000 2000 --decode-lora-kernels "${DECODE_LORA:-bgmv}" \
    --prefill-attention "${PREFILL:-sdpa}"
  stamp "headline" $?
  rm -rf "$W/work"
  PYTHONPATH=$ROOT timeout $(time_left 560) python3 -m perf.profile_engine --shape llama3-8b \
    --rate 24 --duration 12 --drain 15 --max-num-seqs 128 --admit-every-steps 4 --adapters 5 2000 \
    --decode-lora-kernels "${DECODE_LORA:-bgmv}" --python-profile --out "$W/profile" > "$W/profile.txt" 2>&1
  stamp "profile" $?
  {
    cat "$W/gpu.txt" "$W/times.txt"
    echo "== headline"; grep -E "^\| engine|ratio|n=" "$W/headline/summary.md" | head -20
    echo "== profile"; grep -E "^==|phase|graph:|eager:" "$W/profile.txt"
  } > "$OUT/headline.txt" 2>&1
  ;;
mixed)
  # mixed-step CUDA graphs (EngineConfig.mixed_step_graphs): their compiled tests (PEFT oracle), the headline with
  # them, then without them (eager prefill / mixed steps, the previous behaviour) at n = 5 and 2000 in one command
  compiled_tests 180 \
    tests/kernels/test_step_graphs.py tests/kernels/test_engine_kernels.py -k "not sgmv and not hybrid"
  headline headline 230 --adapters 5 100 1000 2000
  stamp "headline (mixed-step graphs)" $?
  headline headline_eager $(time_left 575) --adapters 5 2000 --no-mixed-step-graphs
  stamp "headline (eager mixed steps)" $?
  rm -rf "$W/work"
  {
    summary_head
    grep -E "captured|CUDA graphs" "$W/headline.txt" | head -3
    echo "== headline, mixed-step graphs"; grep -E "^\| engine|ratio" "$W/headline/summary.md" | head -20
    echo "== headline, eager mixed steps"; grep -E "^\| engine|ratio" "$W/headline_eager/summary.md" | head -20
  } > "$OUT/mixed.txt" 2>&1
  ;;
final)
  # the tree as it stands: the server's TTFT at FRACTIONS of SATURATION (no perf_analyzer), the headline, then the
  # headline at n = 5 and 2000 with LOAD_PROCESSES adapter loader processes (the engine's default on this host: 4)
  EXTRA_PARAMS=${EXTRA_PARAMS:-} PERF_ANALYZER=0 SATURATION=${SATURATION:-15.4} DURATION=${DURATION:-10} \
    timeout 190 bash perf/h200/server_latency.sh "$W/server" > "$W/server_latency.txt" 2>&1
  stamp "server latency" $?
  headline headline 220 --adapters 5 100 1000 2000
  stamp "headline" $?
  headline headline_procs $(time_left 575) --adapters 5 2000 --adapter-load-processes "${LOAD_PROCESSES:-8}"
  stamp "headline (${LOAD_PROCESSES:-8} loader processes)" $?
  rm -rf "$W/work"
  {
    cat "$W/gpu.txt" "$W/times.txt"
    echo "== server"; grep -E "ready after|^\\|" "$W/server_latency.txt" | sort -u
    headline_lines
    echo "== headline, ${LOAD_PROCESSES:-8} loader processes"; grep -E "^\| engine|ratio" "$W/headline_procs/summary.md"
  } > "$OUT/final.txt" 2>&1
  ;;
profile)
  # where the engine's time goes on this tree: step phases at n = 5 and n = 2000 (synchronising timers), then
  # n = 2000 again under cProfile with torch.profiler tables of a few eager steps, then the server's TTFT at
  # FRACTIONS of SATURATION (no perf_analyzer)
  PYTHONPATH=$ROOT timeout 200 python3 -m perf.profile_engine --shape llama3-8b --rate 24 --duration 12 --drain 15 \
    --max-num-seqs 128 --admit-every-steps 4 --adapters 5 2000 --out "$W/phases" > "$W/phases.txt" 2>&1
  stamp "profile phases" $?
  PYTHONPATH=$ROOT timeout 150 python3 -m perf.profile_engine --shape llama3-8b --rate 24 --duration 12 --drain 15 \
    --max-num-seqs 128 --admit-every-steps 4 --adapters 2000 --python-profile --trace-steps 3 \
    --out "$W/cprofile" > "$W/cprofile.txt" 2>&1
  stamp "profile cProfile + trace" $?
  EXTRA_PARAMS=${EXTRA_PARAMS:-} PERF_ANALYZER=0 SATURATION=${SATURATION:-15} DURATION=${DURATION:-10} \
    timeout $(time_left 560 60) bash perf/h200/server_latency.sh "$W/server" > "$W/server_latency.txt" 2>&1
  stamp "server latency" $?
  {
    cat "$W/gpu.txt" "$W/times.txt"
    echo "== phases"; grep -E "^==|phase|graph:|eager:|idle|upload|load" "$W/phases.txt" | head -40
    echo "== cProfile top"; head -45 "$W/cprofile/python_profile.txt" 2>/dev/null | cut -c1-150
    echo "== server"; grep -E "ready after|^\\|" "$W/server_latency.txt" | sort -u
  } > "$OUT/profile.txt" 2>&1
  ;;
server)
  EXTRA_PARAMS=${EXTRA_PARAMS:-} PERF_ANALYZER=1 PA_RATES=${PA_RATES:-"2 4 6 8"} SATURATION=${SATURATION:-14} \
    DURATION=${DURATION:-10} PA_MEASURE_MS=${PA_MEASURE_MS:-8000} timeout ${SERVER_TIMEOUT:-560} \
    bash perf/h200/server_latency.sh "$W/server" > "$W/server_latency.txt" 2>&1
  stamp "server latency + perf_analyzer" $?
  cp "$W/server/perf_analyzer.txt" "$W/server/server.log" "$OUT/" 2>/dev/null
  {
    cat "$W/gpu.txt" "$W/times.txt"
    grep -E "ready after|saturation \|" "$W/server_latency.txt" | sort -u
    echo "== perf_analyzer"; grep -E "^== |Throughput|latency|failed|Request Rate|Concurrency" \
      "$W/server/perf_analyzer.txt" | head -60
  } > "$OUT/server.txt" 2>&1
  ;;
*)
  echo "unknown part $PART" >&2
  exit 2
  ;;
esac
tar czf "$OUT/one_$PART.tgz" -C /tmp "one_$PART" 2>/dev/null
cat "$OUT/$PART.txt"

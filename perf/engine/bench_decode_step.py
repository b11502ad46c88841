"""Decode-step time of the whole model: base only vs N distinct adapters, against the bytes floor.

    python -m perf.engine.bench_decode_step --shape llama3-8b --batch 64 --context 512 --adapters 0,8,32,64

Random bf16 weights made on the GPU, adapters of one rank on all 7 projections resident in the
unified pool, a batch of sequences with `context` tokens of random KV each; the decode step is
replayed from the engine's CUDA graph (manylora/engine/execution/cuda_graphs.py) and timed with CUDA events. The
floor is (base weights a step reads + distinct adapters' weights + the batch's KV) / the device-to-device
copy bandwidth measured in the same run (bytes read + written / time). The base weights a step reads are all of
them but the embedding table of an untied model, of which it reads the batch's rows only (before the fourth
series of runs of 2026-12-01 the whole table was counted: a floor 1.05 GB too high for Llama-3-8B, ratios ~4% too
low).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from manylora.engine.adapters.packing import PackedAdapter, _layout
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.config import BASE_GEMMS, DECODE_BLAS, EngineConfig, check_decode_form_name
from manylora.engine.execution.cuda_graphs import DecodeGraphs, DecodeInputs
from manylora.engine.layers import lora_batch
from manylora.engine.layers.decode_gemms import MEASURED_SMS, parse_carveout, sm_carveout_for
from manylora.engine.memory.adapter_slots import AdapterPool
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.unified_pool import UnifiedPool
from manylora.engine.model_config import PROJECTIONS, ModelConfig
from manylora.engine.models.llama import AUTO_TRITON_MAX_ROWS, LlamaModel, weight_names
from manylora.kernels import paged_attention
from perf.engine.shapes import SHAPES
from perf.engine.stream_timeline import KernelEvent, format_split, kernel_events, split_step_time

ENGINE_DEFAULTS = EngineConfig(model_dir="")


def random_model(cfg: ModelConfig, max_len: int, device: str, dtype: torch.dtype) -> LlamaModel:
    tensors = {}
    with torch.device(device):
        for name in weight_names(cfg):
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(_shape(cfg, name), dtype=dtype)
            else:
                tensors[name] = torch.randn(_shape(cfg, name), dtype=dtype) * 0.02
    return LlamaModel(cfg, tensors, max_len, device, dtype)


def _shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, cfg.hidden_size)
    if name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
        return (cfg.head_dim,)
    if name.endswith("norm.weight"):
        return (cfg.hidden_size,)
    module = name.split(".")[-2]
    n_in, n_out = cfg.projection_shape(module)
    return (n_out, n_in) if name.endswith("weight") else (n_out,)


def random_adapter(name: str, cfg: ModelConfig, rank: int, pool: UnifiedPool, max_rank: int) -> PackedAdapter:
    """A packed adapter of random rows (no disk, no per-row Python copies: benchmark only)."""
    layer_ranks = {(layer, m): rank for layer in range(cfg.num_layers) for m in PROJECTIONS}
    spec = AdapterSpec(
        name=name,
        path="<random>",
        sha256=f"{hash(name) & (2**64 - 1):064x}",
        rank=rank,
        ranks=dict.fromkeys(PROJECTIONS, rank),
        target_modules=PROJECTIONS,
        layers=tuple(range(cfg.num_layers)),
        scaling=dict.fromkeys(layer_ranks, 2.0),
        layer_ranks=layer_ranks,
    )
    num_pages, rows = _layout(spec, cfg, pool.page_elems)
    offsets = torch.full((cfg.num_layers, len(PROJECTIONS), 2, max_rank), -1, dtype=torch.int64)
    for layer, m, kind, k, offset, _length in rows:
        offsets[layer, m, kind, k] = offset
    data = torch.randn(num_pages, pool.page_elems, dtype=pool.storage.dtype) * 0.02
    ranks = torch.full((cfg.num_layers, len(PROJECTIONS)), rank, dtype=torch.int32)
    return PackedAdapter(spec, data, offsets, ranks, torch.full(ranks.shape, 2.0))


def step_weight_bytes(model: LlamaModel, batch: int) -> int:
    """Bytes of base weights one decode step of ``batch`` tokens reads: every weight, but of an untied embedding
    table only the batch's rows (a tied table is read whole by the LM head)."""
    total = model.weight_bytes()
    if model.embed.data_ptr() != model.lm_head.data_ptr():
        total -= (model.embed.shape[0] - batch) * model.embed.shape[1] * model.embed.element_size()
    return total


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:])


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_kernels(fn, label: str, out_dir: Path, replays: int = 5,
                    file_name: str = "decode_step_kernels.txt") -> None:
    """Print (and append to out_dir/file_name) the kernels of ``replays`` calls of fn by GPU time, per step, and
    how the step's wall time splits between its stream, waits for the LoRA side stream and gaps
    (``perf/engine/stream_timeline.py``): what the step's time is made of."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / replays
    lines = [f"-- {label}: {total / 1e3:.3f} ms of kernels per step, {sum(e.count for e in rows) // replays} launches"]
    for e in rows[:20]:
        lines.append(f"  {e.self_device_time_total / replays / 1e3:7.3f} ms  {e.count // replays:5d} x "
                     f"{e.self_device_time_total / max(1, e.count):7.2f} us  {e.key[:90]}")
    try:
        lines.append(format_split(split_step_time(_trace_events(prof, out_dir), replays)))
    except Exception as exc:  # the kernel list above must not be lost to the trace's export or parsing
        lines.append(f"   per step: no stream split ({exc!r})")
    text = "\n".join(lines)
    print(text, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / file_name, "a") as f:
        f.write(text + "\n")


def _trace_events(prof, out_dir: Path) -> list[KernelEvent]:
    """The profiled GPU activities, through the chrome trace (the one export that names each kernel's stream)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "decode_step_trace.json"
    prof.export_chrome_trace(str(path))
    events = kernel_events(json.loads(path.read_text()))
    path.unlink()  # megabytes per profile; the split printed from it is what is kept
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--adapters", default="0,8,32,64")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3,
                    help="timings of every variant in turn, this many times; the median is reported")
    ap.add_argument("--norm", choices=["fused", "torch"], default="fused",
                    help="residual add + RMSNorm as the engine's kernel path runs it (fused), or as torch ops")
    ap.add_argument("--silu-mul", choices=["fused", "torch"], default="fused",
                    help="the MLP's silu(gate) * up as the engine's kernel path runs it (fused), or as torch ops")
    ap.add_argument("--decode-lora-kernels", default="bgmv",
                    help="the LoRA kernels of the captured step (EngineConfig.decode_lora_kernels): bgmv (one program "
                         "per token), sgmv (tokens grouped by adapter on the device) or hybrid (BGMV shrink, SGMV "
                         "expand); comma-separated: each in turn, on the same model, pool and batch")
    ap.add_argument("--rope-kv", default="fused",
                    help="each layer's RoPE + KV-cache write as the engine's kernel path runs it (fused: one Triton "
                         "kernel) or as torch ops (torch); comma-separated: each in turn, on the same model and batch")
    ap.add_argument("--lora-side-stream", default="on",
                    help="captured steps run each LoRA shrink on a side stream beside its base GEMM (on) or in line "
                         "(off); comma-separated: each in turn")
    ap.add_argument("--defer-expand", default="on",
                    help="with the side stream, captured steps run each LoRA expand whose consumer is a fused kernel "
                         "beside the base GEMM too, the consumer adding its term (on), or in place after the GEMM "
                         "(off); comma-separated: each in turn")
    ap.add_argument("--shrink-order", default="before",
                    help="with the side stream, each shrink's node captured before its base GEMM's (before) or after "
                         "it, from the same point (after: the GEMM launched first; LoraBatch.fork); comma-separated: "
                         "each in turn")
    ap.add_argument("--attention-splits", default="auto",
                    help="comma-separated: auto (paged_attention.attention_splits' choice) and/or split counts "
                         "of the paged decode attention (1: one pass, never split)")
    ap.add_argument("--base-gemm", default="torch",
                    help="the base layers' GEMMs and the LM head (EngineConfig.base_gemm): torch (cuBLAS) or triton "
                         "(manylora/kernels/skinny_gemm.py, split-K); comma-separated: each in turn")
    ap.add_argument("--blas", default=ENGINE_DEFAULTS.decode_gemm_blas,
                    help="the cuBLAS interface of the captured step's base GEMMs (EngineConfig.decode_gemm_blas): "
                         "cublas or cublaslt; comma-separated: each in turn")
    defaults = ENGINE_DEFAULTS
    ap.add_argument("--sm-carveout", default="/".join(filter(None, [
        str(sm_carveout_for(defaults.decode_gemm_sm_carveout, defaults.decode_gemm_blas, MEASURED_SMS)),
        defaults.decode_gemm_group_carveouts])),
                    help="SMs the base GEMMs of the steps with adapters leave to the LoRA side stream, each shrink "
                         "then captured after its GEMM whatever --shrink-order says; N or N/group=N/... for per "
                         "projection group counts (qkv, o, gate_up, down), e.g. 32/qkv=64/gate_up=16 "
                         "(EngineConfig.decode_gemm_sm_carveout, decode_gemm_group_carveouts; cuBLASLt only: "
                         "combinations with cublas are skipped); comma-separated: each in turn")
    ap.add_argument("--profile", action="store_true",
                    help="also print the step's kernels by GPU time (torch.profiler over 5 replays per adapter count)")
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    device, dtype = "cuda", torch.bfloat16
    counts = [int(n) for n in args.adapters.split(",")]
    cfg = ModelConfig.from_dict(SHAPES[args.shape])
    torch.manual_seed(0)

    bandwidth = copy_bandwidth(device)
    model = random_model(cfg, args.context + 64, device, dtype)
    # as the engine sets them on its kernel path
    model.use_kernels = args.norm == "fused" or args.silu_mul == "fused"
    model.fuse_add_norm, model.fuse_silu_mul = args.norm == "fused", args.silu_mul == "fused"
    print(f"residual add + RMSNorm: {args.norm}; silu(gate) * up: {args.silu_mul}")
    blocks = -(-(args.context + 1) // args.page_size)
    probe = UnifiedPool(cfg, 1, args.page_size, dtype, device)
    one = random_adapter("probe", cfg, args.rank, probe, args.rank)
    num_pages = args.batch * blocks + max(counts) * one.num_pages + 1
    del probe
    pool = UnifiedPool(cfg, num_pages, args.page_size, dtype, device)
    pool.storage.normal_(0, 0.5)  # random KV; adapter pages are overwritten below
    kv = PagedKVCache(pool)
    adapters = AdapterPool(pool, device)
    resident = [adapters.upload(random_adapter(f"a{i}", cfg, args.rank, pool, args.rank)) for i in range(max(counts))]
    tables = [pool.pages.allocate(("seq", b), blocks) for b in range(args.batch)]
    scratch = pool.pages.allocate("scratch", 1)[0]
    forms = args.decode_lora_kernels.split(",")
    for form in forms:
        try:
            check_decode_form_name(form, "--decode-lora-kernels")
        except ValueError as e:
            ap.error(str(e))
    rope_kvs = args.rope_kv.split(",")
    if not set(rope_kvs) <= {"fused", "torch"}:
        ap.error(f"--rope-kv takes fused and/or torch, got {args.rope_kv!r}")
    side_streams = args.lora_side_stream.split(",")
    if not set(side_streams) <= {"on", "off"}:
        ap.error(f"--lora-side-stream takes on and/or off, got {args.lora_side_stream!r}")
    defers = args.defer_expand.split(",")
    if not set(defers) <= {"on", "off"}:
        ap.error(f"--defer-expand takes on and/or off, got {args.defer_expand!r}")
    orders = args.shrink_order.split(",")
    if not set(orders) <= {"before", "after"}:
        ap.error(f"--shrink-order takes before and/or after, got {args.shrink_order!r}")
    base_gemms = args.base_gemm.split(",")
    if not set(base_gemms) <= set(BASE_GEMMS):
        ap.error(f"--base-gemm takes {' and/or '.join(BASE_GEMMS)}, got {args.base_gemm!r}")
    blases = args.blas.split(",")
    if not set(blases) <= set(DECODE_BLAS):
        ap.error(f"--blas takes {' and/or '.join(DECODE_BLAS)}, got {args.blas!r}")
    try:
        carveouts = [(spec, *parse_carveout(spec)) for spec in args.sm_carveout.split(",")]
    except ValueError as e:
        ap.error(f"--sm-carveout: {e}")

    def carves(carveout: tuple) -> bool:
        """Whether a (spec, SMs, group SMs) carveout leaves any GEMM's SMs to the side stream."""
        return carveout[1] > 0 or any(sms > 0 for _, sms in carveout[2])
    attention_splits = args.attention_splits.split(",")
    if not all(a == "auto" or (a.isdigit() and int(a) >= 1) for a in attention_splits):
        ap.error(f"--attention-splits takes auto and/or positive counts, got {args.attention_splits!r}")
    page = args.page_size
    positions = torch.full((args.batch,), args.context, dtype=torch.int64)
    slots = torch.tensor([t[args.context // page] * page + args.context % page for t in tables])
    ids = torch.randint(0, cfg.vocab_size, (args.batch,))
    base_bytes = step_weight_bytes(model, args.batch)
    elem = torch.tensor([], dtype=dtype).element_size()
    adapter_bytes = args.rank * sum(sum(cfg.projection_shape(m)) for m in PROJECTIONS) * cfg.num_layers * elem
    kv_bytes = args.batch * (args.context + 1) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    rows = []
    capture_s = {}
    variants = [(form, rope_kv, side, defer, order, gemm, splits, blas, carveout) for form in forms
                for rope_kv in rope_kvs for side in side_streams for defer in defers for order in orders
                for gemm in base_gemms for splits in attention_splits for blas in blases for carveout in carveouts
                # a carveout needs cuBLASLt and captures each shrink after its GEMM: one order of it
                if not carves(carveout) or (blas == "cublaslt" and order == orders[-1])]
    captured = []  # every variant's graphs, captured first and kept: the rounds then time them in turn
    for form, rope_kv, side, defer, order, gemm, splits, blas, carveout in variants:
        paged_attention.SPLITS_OVERRIDE = None if splits == "auto" else int(splits)  # read at capture
        model.fuse_rope_kv = rope_kv == "fused"
        lora_batch.SIDE_STREAM = side == "on"
        lora_batch.DEFER_EXPAND = defer == "on"
        lora_batch.SHRINK_AFTER_GEMM = order == "after"
        model.base_gemm = gemm
        graphs = DecodeGraphs(model, kv, scratch, args.batch, blocks, max(max(counts), 1), args.rank,
                              decode_form=form, gemm_blas=blas, gemm_sm_carveout=carveout[1],
                              gemm_group_carveouts=carveout[2])
        order = "after" if carves(carveout) else order
        carveout = carveout[0]
        # base_gemm "auto" captures the shrink after its Triton GEMM whatever --shrink-order says, up to
        # AUTO_TRITON_MAX_ROWS tokens (LlamaModel._project)
        order = "after" if gemm == "auto" and args.batch <= AUTO_TRITON_MAX_ROWS else order
        label = (f"{form}, rope+kv {rope_kv}, side stream {side}, defer expand {defer}, shrink {order} gemm, "
                 f"base gemm {gemm}, attention splits {splits}, {blas}, carveout {carveout}")
        print(f"LoRA kernels of the decode step: {form}; RoPE + KV write: {rope_kv}; LoRA side stream: {side}; "
              f"deferred expand: {defer}; shrink captured {order} its GEMM; base GEMMs: {gemm}; "
              f"attention splits: {splits}; {blas}, SM carveout {carveout}", flush=True)
        graphs.buckets = [args.batch]
        t0 = time.perf_counter()
        graphs._reset_padding(args.batch)
        graphs._capture(args.batch, True)
        graphs._capture(args.batch, False)
        capture_s[label] = round(time.perf_counter() - t0, 1)
        captured.append(((form, rope_kv, side, defer, order, gemm, splits, blas, carveout), label, graphs))

    def replay(graphs: DecodeGraphs, n: int):
        """One decode step of the batch over n distinct adapters (0: base only, the graph without LoRA)."""
        inputs = DecodeInputs(ids, positions, slots, tables, [args.context + 1] * args.batch,
                              [b % n for b in range(args.batch)] if n else [-1] * args.batch, resident[:n])
        return lambda: graphs.run(inputs)

    # rounds over all variants in turn, so that whatever drifts over the run falls on every variant alike: timed
    # one variant after the other, each adapter count profiled right after its timing, the base-only graphs of two
    # variants (the same kernels) took 6.36 ms in the first and 6.86 ms in the second (2026-12-02-h200/20_defer;
    # clocks, heat or the profiler runs between them, not told apart). Profiles now come after all timings.
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for _, label, graphs in captured:
            for n in counts:
                times.setdefault((label, n), []).append(time_ms(replay(graphs, n), args.iters))
    for (form, rope_kv, side, defer, order, gemm, splits, blas, carveout), label, graphs in captured:
        for n in counts:
            if args.profile:
                try:
                    profile_kernels(replay(graphs, n), f"{label}, {n} adapters", Path(args.out))
                except Exception as exc:  # a profiler that cannot see graph kernels must not cost the timing rows
                    print(f"profile of {n} adapters failed: {exc!r}", flush=True)
            step_ms = statistics.median(times[(label, n)])
            floor_ms = (base_bytes + n * adapter_bytes + kv_bytes) / bandwidth * 1e3
            rows.append(
                {
                    "lora_kernels": form,
                    "rope_kv": rope_kv,
                    "side_stream": side,
                    "defer_expand": defer,
                    "shrink_order": order,
                    "base_gemm": gemm,
                    "attention_splits": splits,
                    "blas": blas,
                    "sm_carveout": carveout,
                    "adapters": n,
                    "step_ms": round(step_ms, 3),
                    "step_ms_rounds": [round(t, 3) for t in times[(label, n)]],
                    "floor_ms": round(floor_ms, 3),
                    "step_over_floor": round(step_ms / floor_ms, 3),
                    "tokens_per_s": round(args.batch / step_ms * 1e3, 1),
                }
            )
    paged_attention.SPLITS_OVERRIDE = None
    graphs._reset_padding(args.batch)  # the last form's tables: an eager base-only step over them
    eager_base = time_ms(lambda: model.forward(graphs._batch(args.batch), kv, None), 10)

    result = {
        "date": date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "batch": args.batch,
        "context": args.context,
        "rank": args.rank,
        "page_size": args.page_size,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "base_weight_GB": round(base_bytes / 1e9, 3),
        "adapter_MB": round(adapter_bytes / 1e6, 2),
        "kv_GB": round(kv_bytes / 1e9, 3),
        "graph_capture_s": capture_s,
        "eager_base_step_ms": round(eager_base, 3),
        "rows": rows,
        "command": "python -m perf.engine.bench_decode_step "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_step.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print(f"{'adapters':>8} {'step ms':>8} {'floor ms':>9} {'x floor':>8} {'tok/s':>9} {'vs base':>8}  LoRA kernels, "
          "RoPE + KV write, LoRA side stream, deferred expand, shrink order, base GEMMs, attention splits, BLAS, SM "
          "carveout")

    def variant(r: dict) -> tuple[str, ...]:
        return (r["lora_kernels"], r["rope_kv"], r["side_stream"], r["defer_expand"], r["shrink_order"],
                r["base_gemm"], r["attention_splits"], r["blas"], str(r["sm_carveout"]))

    base_ms = {variant(r): r["step_ms"] for r in rows if r["adapters"] == 0}
    for r in rows:
        base = base_ms.get(variant(r))
        rel = f"{r['step_ms'] / base:8.2f}" if base else " " * 8
        print(
            f"{r['adapters']:>8} {r['step_ms']:>8.3f} {r['floor_ms']:>9.3f} {r['step_over_floor']:>8.2f} "
            f"{r['tokens_per_s']:>9.1f} {rel}  {', '.join(variant(r))}"
        )


if __name__ == "__main__":
    main()

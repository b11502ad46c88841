"""The headline benchmark in one process: engine at n = 5/100/1000/2000 adapters, base-only, PEFT baselines.

    python -m perf.engine.headline --shape llama3-8b            # one GPU, about 8 minutes on an H200
    python -m perf.engine.headline --shape tiny --device cpu    # CPU smoke test, 1-2 minutes

Builds a random-weight checkpoint of the shape (sharded safetensors in a temporary
directory), loads it through the real loader (manylora.engine.scheduling.engine.Engine), registers n rank-16
adapters on all 7 projections (a few distinct adapter files, many names each: see
perf/engine/checkpoint.py), then replays S-LoRA's workload (power-law adapters, Gamma arrivals,
uniform lengths; the same arrivals and lengths for every n) against:
the engine at each n, the engine serving the base model only, and transformers+PEFT with
mixed-adapter batches and one adapter at a time at n = 100 (capped). Writes per-request
JSONL, summary JSON, summary.md, results.json and PNG plots to --out (default $OUT, else
perf/results/<date>/) and prints a short table last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from manylora.engine.config import BASE_GEMMS, DECODE_BLAS, DECODE_FORMS
from perf.engine.checkpoint import SHAPES, write_adapter_catalogue, write_base
from perf.workload.plots import throughput_vs_adapters, ttft_cdf
from perf.workload.report import SLO_TTFT_S, Summary, markdown_table
from perf.workload.runner import run_target
from perf.workload.trace import WorkloadConfig, adapter_name, base_only, generate_trace


@dataclass
class HeadlineConfig:
    """One headline run. Per-shape defaults come from :data:`DEFAULTS`."""

    shape: str = "tiny"
    device: str = "auto"
    adapter_counts: list[int] = field(default_factory=lambda: [5, 100, 1000, 2000])
    peft_adapters: int = 100
    rank: int = 16
    distinct_adapters: int = 8
    alpha: float = 1.0
    cv: float = 1.0
    rate: float = 4.0
    duration_s: float = 10.0
    drain_s: float = 10.0  # after the last arrival, how long an engine run may take to finish
    peft_duration_s: float = 10.0  # cap of each PEFT run from its start
    peft_max_batch: int = 16
    input_range: tuple[int, int] = (8, 64)
    output_range: tuple[int, int] = (8, 64)
    max_num_seqs: int = 64
    max_cpu_loras: int | None = None
    admit_every_steps: int = 1
    adapter_load_processes: int | None = None  # None: the engine's default for the device
    prefill_attention: str = "sdpa"  # EngineConfig.prefill_attention
    decode_lora_kernels: str = "bgmv"  # EngineConfig.decode_lora_kernels
    base_gemm: str = "torch"  # EngineConfig.base_gemm
    decode_gemm_blas: str = "cublaslt"  # EngineConfig.decode_gemm_blas
    decode_gemm_sm_carveout: int | None = None  # EngineConfig.decode_gemm_sm_carveout (None: 32 on the H200)
    decode_gemm_group_carveouts: str = ""  # EngineConfig.decode_gemm_group_carveouts ("": none)
    mixed_step_graphs: bool = True  # EngineConfig.mixed_step_graphs
    slo_s: float = SLO_TTFT_S
    seed: int = 0
    skip_peft: bool = False
    workdir: str | None = None  # where the checkpoint is written (default: a temporary directory)


DEFAULTS: dict[str, dict] = {
    # S-LoRA's lengths [8, 512); ~45 s of trace per engine config, PEFT capped at 40 s: < 9 minutes in all.
    "llama3-8b": dict(
        rate=6.0,
        duration_s=45.0,
        drain_s=20.0,
        peft_duration_s=40.0,
        input_range=(8, 512),
        output_range=(8, 512),
        max_num_seqs=128,
        max_cpu_loras=256,
        peft_max_batch=16,
    ),
    "tiny": dict(
        rate=4.0,
        duration_s=8.0,
        drain_s=8.0,
        peft_duration_s=8.0,
        input_range=(8, 64),
        output_range=(8, 64),
        max_num_seqs=64,
        peft_max_batch=8,
    ),
}


def _log(msg: str) -> None:
    print(f"[headline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free_device(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _warm_up(engine) -> None:
    """A few requests of several sizes, so that kernel compilation is not measured."""
    from manylora.engine.requests.types import GenerationRequest, SamplingParams
    from manylora.engine.scheduling.offline import generate

    vocab = engine.model_config.vocab_size
    names = engine.catalogue.names()[:3]
    reqs = [
        GenerationRequest(
            f"warm-{i}", [4 + (7 * j) % (vocab - 4) for j in range(n)], a, SamplingParams(max_tokens=8, ignore_eos=True)
        )
        for i, (n, a) in enumerate(
            [(8, None), (100, names[0] if names else None), (300, None)] + [(16, a) for a in names]
        )
    ]
    generate(engine, reqs, timeout=600)


def run(cfg: HeadlineConfig, out: Path) -> dict:
    from manylora.engine.config import EngineConfig
    from manylora.engine.devices import resolve_device
    from manylora.engine.scheduling.engine import Engine
    from perf.engine.engine_target import EngineTarget
    from perf.peers.peft_generate import PeftBaselineConfig, PeftTarget, load_peft_model

    shape = SHAPES[cfg.shape]
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    timings: dict[str, float] = {}
    tmp = tempfile.TemporaryDirectory(prefix="manylora-headline-", dir=cfg.workdir)
    root = Path(tmp.name)
    try:
        t = time.perf_counter()
        build_device = device if device.startswith("cuda") else "cpu"
        base_dir = write_base(root / "base", shape, dtype=dtype, device=build_device)
        n_max = max(cfg.adapter_counts + [cfg.peft_adapters])
        names = [adapter_name(i) for i in range(n_max)]
        catalogue = write_adapter_catalogue(
            root / "adapters",
            shape,
            names,
            distinct=cfg.distinct_adapters,
            rank=cfg.rank,
            dtype=dtype,
            device=build_device,
            base_dir=str(base_dir),
        )
        timings["write_checkpoint_s"] = time.perf_counter() - t
        distinct = min(cfg.distinct_adapters, n_max)
        notes.append(
            f"{n_max} adapter names point at {distinct} distinct rank-{cfg.rank} adapter directories "
            f"(sha256s repeat; the engine keys its caches on the name, so each name is loaded on its own; "
            f"the OS page cache holds only the distinct files)"
        )
        _log(f"checkpoint {cfg.shape} and {distinct} distinct adapters written in {timings['write_checkpoint_s']:.1f}s")

        t = time.perf_counter()
        engine = Engine(
            EngineConfig(
                model_dir=str(base_dir),
                device=device,
                max_lora_rank=max(16, cfg.rank),
                max_num_seqs=cfg.max_num_seqs,
                max_loras=cfg.max_num_seqs,  # S-LoRA caps no adapter diversity per batch
                max_cpu_loras=cfg.max_cpu_loras,
                admit_every_steps=cfg.admit_every_steps,
                adapter_load_processes=cfg.adapter_load_processes,
                prefill_attention=cfg.prefill_attention,
                decode_lora_kernels=cfg.decode_lora_kernels,
                base_gemm=cfg.base_gemm,
                decode_gemm_blas=cfg.decode_gemm_blas,
                decode_gemm_sm_carveout=cfg.decode_gemm_sm_carveout,
                decode_gemm_group_carveouts=cfg.decode_gemm_group_carveouts,
                mixed_step_graphs=cfg.mixed_step_graphs,
                max_model_len=cfg.input_range[1] + cfg.output_range[1] + 8,
            )
        )
        timings["engine_load_s"] = time.perf_counter() - t
        t = time.perf_counter()
        errors = engine.catalogue.register_all(catalogue, strict=False, workers=max(4, os.cpu_count() or 4))
        if errors:
            raise RuntimeError(f"{len(errors)} adapters refused, e.g. {next(iter(errors.values()))}")
        timings["register_adapters_s"] = time.perf_counter() - t
        _log(
            f"engine loaded in {timings['engine_load_s']:.1f}s; {len(catalogue)} adapters registered in "
            f"{timings['register_adapters_s']:.1f}s"
        )
        t = time.perf_counter()
        _warm_up(engine)
        timings["warm_up_s"] = time.perf_counter() - t

        def trace_for(n: int):
            return generate_trace(
                WorkloadConfig(
                    num_adapters=n,
                    alpha=cfg.alpha,
                    rate=cfg.rate,
                    cv=cfg.cv,
                    duration_s=cfg.duration_s,
                    input_range=cfg.input_range,
                    output_range=cfg.output_range,
                    seed=cfg.seed,
                    vocab_range=(4, shape.vocab),
                )
            )

        cap = cfg.duration_s + cfg.drain_s
        summaries: dict[str, Summary] = {}
        records: dict[str, list] = {}
        runs = [("engine base-only", base_only(trace_for(cfg.peft_adapters)))]
        runs += [(f"engine n={n}", trace_for(n)) for n in cfg.adapter_counts]
        for name, trace in runs:
            _log(f"{name}: {len(trace)} requests over {trace[-1].arrival_s:.0f}s")
            s, result = run_target(
                name,
                trace,
                EngineTarget(engine, name=name, run_id=name.replace(" ", "_")),
                out,
                max_duration_s=cap,
                slo_s=cfg.slo_s,
                meta={"engine_stats": _stats(engine)},
            )
            summaries[name], records[name] = s, result.records
            _log(f"{name}: {s.completed}/{s.sent} done, {s.req_per_s:.2f} req/s, TTFT p50 {s.ttft_p50}")
        engine.shutdown()
        del engine
        _free_device(device)

        if not cfg.skip_peft:
            trace = trace_for(cfg.peft_adapters)
            wanted = {r.adapter for r in trace if r.adapter and r.arrival_s < cfg.peft_duration_s}
            model, load_s = load_peft_model(base_dir, {a: catalogue[a] for a in sorted(wanted)}, device, dtype)
            timings["peft_load_s"] = load_s
            _log(f"PEFT: base + {len(wanted)} adapters loaded in {load_s:.1f}s")
            for mode in ("mixed", "single"):
                name = f"peft-{mode} n={cfg.peft_adapters}"
                target = PeftTarget(
                    model, PeftBaselineConfig(mode=mode, max_batch_size=cfg.peft_max_batch), device, name=name
                )
                s, result = run_target(
                    name,
                    trace,
                    target,
                    out,
                    max_duration_s=cfg.peft_duration_s,
                    slo_s=cfg.slo_s,
                    meta={"batches": target.batches, "max_batch_size": cfg.peft_max_batch},
                )
                summaries[name], records[name] = s, result.records
                _log(
                    f"{name}: {s.completed}/{s.sent} done in the {cfg.peft_duration_s:.0f}s cap, "
                    f"{s.req_per_s:.2f} req/s"
                )
            del model
            _free_device(device)
    finally:
        tmp.cleanup()

    ratios = _ratios(summaries, cfg)
    results = {
        "config": asdict(cfg),
        "device": _device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "timings": timings,
        "notes": notes,
        "ratios": ratios,
        "summaries": {k: asdict(v) for k, v in summaries.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown_table(list(summaries.values()))
    (out / "summary.md").write_text(_markdown(cfg, results, table))
    engine_points = [(n, summaries[f"engine n={n}"]) for n in cfg.adapter_counts]
    refs = {"engine base-only": summaries["engine base-only"].req_per_s}
    refs.update({k: v.req_per_s for k, v in summaries.items() if k.startswith("peft")})
    throughput_vs_adapters(engine_points, out / "throughput_vs_adapters.png", refs)
    ttft_cdf(records, out / "ttft_cdf.png", cfg.slo_s)
    return {"table": table, "ratios": ratios, "notes": notes, "timings": timings}


def _stats(engine) -> dict:
    s = engine.stats()
    return {k: s[k] for k in ("steps", "preemptions", "adapter_uploads", "adapter_evictions") if k in s}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _ratios(s: dict[str, Summary], cfg: HeadlineConfig) -> dict:
    def rps(key: str) -> float | None:
        return s[key].req_per_s if key in s else None

    lo, hi, mid = min(cfg.adapter_counts), max(cfg.adapter_counts), cfg.peft_adapters
    return {
        f"engine / peft-mixed at n={mid} (req/s)": _ratio(rps(f"engine n={mid}"), rps(f"peft-mixed n={mid}")),
        f"engine / peft-single at n={mid} (req/s)": _ratio(rps(f"engine n={mid}"), rps(f"peft-single n={mid}")),
        f"engine n={hi} / n={lo} (req/s)": _ratio(rps(f"engine n={hi}"), rps(f"engine n={lo}")),
        f"engine n={mid} / base-only (req/s)": _ratio(rps(f"engine n={mid}"), rps("engine base-only")),
    }


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({os.cpu_count()} cores)"


def _markdown(cfg: HeadlineConfig, results: dict, table: str) -> str:
    lines = [
        f"# Headline: {cfg.shape} on {results['device']} ({results['dtype']})",
        "",
        f"Workload: S-LoRA synthetic, alpha={cfg.alpha}, cv={cfg.cv}, {cfg.rate} req/s for {cfg.duration_s:g} s, "
        f"input {list(cfg.input_range)}, output {list(cfg.output_range)}, seed {cfg.seed}; engine runs capped at "
        f"{cfg.duration_s + cfg.drain_s:g} s, PEFT runs at {cfg.peft_duration_s:g} s. "
        f"TTFT/latency in s; SLO = TTFT < {cfg.slo_s:g} s.",
        "",
        table,
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in results["ratios"].items()]
    lines += [f"- {n}" for n in results["notes"]]
    lines += [f"- timings: {json.dumps({k: round(v, 1) for k, v in results['timings'].items()})}", ""]
    return "\n".join(lines)


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return Path(__file__).resolve().parents[1] / "results" / dt.date.today().isoformat()


def parse_args(argv: list[str] | None = None) -> tuple[HeadlineConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    p.add_argument("--adapters", type=int, nargs="+", dest="adapter_counts")
    p.add_argument("--peft-adapters", type=int)
    p.add_argument("--distinct-adapters", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--alpha", type=float)
    p.add_argument("--cv", type=float)
    p.add_argument("--rate", type=float)
    p.add_argument("--duration", type=float, dest="duration_s")
    p.add_argument("--drain", type=float, dest="drain_s")
    p.add_argument("--peft-duration", type=float, dest="peft_duration_s")
    p.add_argument("--peft-max-batch", type=int)
    p.add_argument("--input-range", type=int, nargs=2)
    p.add_argument("--output-range", type=int, nargs=2)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-cpu-loras", type=int)
    p.add_argument("--admit-every-steps", type=int)
    p.add_argument("--adapter-load-processes", type=int)
    p.add_argument("--prefill-attention", choices=["sdpa", "paged"])
    p.add_argument("--decode-lora-kernels", choices=list(DECODE_FORMS))
    p.add_argument("--base-gemm", choices=list(BASE_GEMMS))
    p.add_argument("--decode-gemm-blas", choices=list(DECODE_BLAS))
    p.add_argument("--decode-gemm-sm-carveout", type=int)
    p.add_argument("--decode-gemm-group-carveouts", help='per projection group SM carveouts, e.g. "qkv=64/gate_up=16"; '
                   '"" for none')
    p.add_argument("--no-mixed-step-graphs", action="store_false", dest="mixed_step_graphs", default=None,
                   help="run prefill and mixed steps eagerly (EngineConfig.mixed_step_graphs=False)")
    p.add_argument("--slo", type=float, dest="slo_s")
    p.add_argument("--seed", type=int)
    p.add_argument("--skip-peft", action="store_true", default=None)
    p.add_argument("--workdir")
    a = vars(p.parse_args(argv))
    out = Path(a.pop("out")) if a.get("out") else default_out()
    values = {**DEFAULTS[a["shape"]], **{k: v for k, v in a.items() if v is not None}}
    for key in ("input_range", "output_range"):
        values[key] = tuple(values[key])
    return HeadlineConfig(**values), out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    t0 = time.perf_counter()
    result = run(cfg, out)
    print(f"\nresults in {out} ({time.perf_counter() - t0:.0f} s in all)\n")
    print(result["table"], end="")
    for k, v in result["ratios"].items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

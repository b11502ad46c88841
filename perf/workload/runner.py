"""Replay a trace against the engine in-process or the running Triton server; write the report.

    # in-process engine
    python -m perf.workload.runner --trace trace.jsonl --engine-model build/default/base \
        --catalogue build/default/catalogue.json --out perf/results/x
    # the running server, generator model with token ids (ids drawn when the trace has none)
    python -m perf.workload.runner --trace trace.jsonl --url 127.0.0.1:8001 --model generator --vocab-range 4 300 \
        --out ...
    # the llm ensemble with S-LoRA's "Hello " * n text prompts
    python -m perf.workload.runner --trace trace.jsonl --url 127.0.0.1:8001 --model llm --out ...

Writes <out>/<name>.requests.jsonl, <name>.summary.json, summary.md and ttft_cdf.png.
Note: through the server, EOS is not switched off (the generator takes no ignore_eos), so a
request may end before output_len; the records keep the tokens actually received.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from perf.workload.plots import ttft_cdf
from perf.workload.replay import ReplayResult, Target, replay
from perf.workload.report import SLO_TTFT_S, Summary, markdown_table, summarize, write_run
from perf.workload.trace import TraceRequest, describe, read_trace, with_token_ids


def run_target(
    name: str,
    trace: list[TraceRequest],
    target: Target,
    out_dir: str | Path | None,
    *,
    max_duration_s: float | None = None,
    slo_s: float = SLO_TTFT_S,
    meta: dict | None = None,
    progress: bool = True,
) -> tuple[Summary, ReplayResult]:
    """Replay, close the target, summarise, and write the per-request JSONL and summary JSON (if out_dir)."""
    try:
        result = replay(trace, target, max_duration_s=max_duration_s, progress=progress)
    finally:
        target.close()
    summary = summarize(
        name, result.records, result.wall_s, slo_s, meta={**describe(trace), "capped": result.capped, **(meta or {})}
    )
    if out_dir is not None:
        write_run(out_dir, summary, result.records)
    return summary, result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default=None)
    p.add_argument("--url", help="Triton gRPC host:port (else the engine in-process)")
    p.add_argument("--model", default="generator", choices=["generator", "llm"])
    p.add_argument("--engine-model", help="base model directory for the in-process engine")
    p.add_argument("--catalogue", help="adapter catalogue JSON for the in-process engine")
    p.add_argument("--device", default="auto")
    p.add_argument("--vocab-range", type=int, nargs=2, help="draw prompt token ids in [lo, hi) when the trace has none")
    p.add_argument("--max-duration", type=float, default=None, help="cap in seconds from the start")
    p.add_argument("--slo", type=float, default=SLO_TTFT_S)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    trace = read_trace(a.trace)
    needs_ids = a.url is None or a.model == "generator"
    if needs_ids and any(r.prompt_ids is None for r in trace):
        if not a.vocab_range:
            p.error("this trace has no token ids: give --vocab-range LO HI")
        trace = with_token_ids(trace, tuple(a.vocab_range))
    engine = None
    if a.url:
        from perf.server.triton_target import TritonTarget

        target = TritonTarget(a.url, a.model)
    else:
        if not a.engine_model:
            p.error("give --url for the server or --engine-model for the in-process engine")
        from manylora.engine.adapters.catalogue import load_catalogue_file
        from manylora.engine.config import EngineConfig
        from manylora.engine.scheduling.engine import Engine
        from perf.engine.engine_target import EngineTarget

        adapters = load_catalogue_file(a.catalogue) if a.catalogue else {}
        engine = Engine(EngineConfig(model_dir=a.engine_model, adapters=adapters, device=a.device))
        target = EngineTarget(engine)
    name = a.name or target.name
    t0 = time.time()
    try:
        summary, result = run_target(
            name, trace, target, a.out, max_duration_s=a.max_duration, slo_s=a.slo, progress=not a.no_progress
        )
    finally:
        if engine is not None:
            engine.shutdown()
    out = Path(a.out)
    (out / "summary.md").write_text(markdown_table([summary]))
    ttft_cdf({name: result.records}, out / "ttft_cdf.png", a.slo)
    print(json.dumps({"elapsed_s": round(time.time() - t0, 1), "out": str(out)}))
    print(markdown_table([summary]), end="")


if __name__ == "__main__":
    main()

"""Summaries of a replay: throughput, TTFT, ITL, latency, SLO attainment; JSON and Markdown."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from perf.workload.records import RequestRecord, write_records

SLO_TTFT_S = 6.0  # S-LoRA: slora/utils/metric.py, response_ub = 6


@dataclass
class Summary:
    """One system on one trace. Times in seconds; None where nothing was measured.

    throughput counts completed requests over wall_s (from the replay's start until the
    last request finished, or until the cap); slo_attainment is over the requests sent
    (a request that never produced a token misses the SLO).
    """

    name: str
    requests: int
    sent: int
    completed: int
    failed: int
    wall_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_mean: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    latency_mean: float | None
    latency_p50: float | None
    latency_p99: float | None
    slo_ttft_s: float
    slo_attainment: float
    first_error: str | None = None
    meta: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy); None for no values."""
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(
    name: str, records: list[RequestRecord], wall_s: float, slo_ttft_s: float = SLO_TTFT_S, meta: dict | None = None
) -> Summary:
    """The summary of one replay's records."""
    sent = [r for r in records if r.send_s is not None]
    done = [r for r in sent if r.completed]
    failed = [r for r in sent if r.error is not None]
    ttfts = [r.ttft for r in sent if r.ttft is not None]
    lats = [r.latency for r in done]
    itls = [g for r in done for g in r.inter_token_latencies()]
    tokens = sum(r.output_tokens for r in done)
    met = sum(1 for r in sent if r.ttft is not None and r.ttft < slo_ttft_s)
    wall = max(wall_s, 1e-9)
    return Summary(
        name=name,
        requests=len(records),
        sent=len(sent),
        completed=len(done),
        failed=len(failed),
        wall_s=wall_s,
        req_per_s=len(done) / wall,
        output_tok_per_s=tokens / wall,
        ttft_mean=_mean(ttfts),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p90=percentile(itls, 90),
        itl_p99=percentile(itls, 99),
        latency_mean=_mean(lats),
        latency_p50=percentile(lats, 50),
        latency_p99=percentile(lats, 99),
        slo_ttft_s=slo_ttft_s,
        slo_attainment=met / len(sent) if sent else 0.0,
        first_error=next((r.error for r in failed), None),
        meta=dict(meta or {}),
    )


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


TABLE_HEADER = (
    "| system | sent | done | req/s | tok/s | TTFT p50 | TTFT p99 | ITL p50 (ms) | ITL p99 (ms) "
    "| lat mean | lat p99 | SLO att. |"
)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def markdown_row(s: Summary) -> str:
    return (
        f"| {s.name} | {s.sent} | {s.completed} | {s.req_per_s:.2f} | {s.output_tok_per_s:.0f} "
        f"| {_fmt(s.ttft_p50)} | {_fmt(s.ttft_p99)} | {_fmt(_ms(s.itl_p50), 1)} | {_fmt(_ms(s.itl_p99), 1)} "
        f"| {_fmt(s.latency_mean)} | {_fmt(s.latency_p99)} | {s.slo_attainment:.2f} |"
    )


def markdown_table(summaries: list[Summary]) -> str:
    sep = "|" + "---|" * (TABLE_HEADER.count("|") - 1)
    return "\n".join([TABLE_HEADER, sep, *(markdown_row(s) for s in summaries)]) + "\n"


def write_run(out_dir: str | Path, summary: Summary, records: list[RequestRecord]) -> Path:
    """<out>/<name>.requests.jsonl and <out>/<name>.summary.json; returns the summary path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # letters, digits, '.', '_' and '-' only: "engine n=100" -> "engine_n100"
    stem = re.sub(r"[^A-Za-z0-9._-]", "", summary.name.replace("/", "_").replace(" ", "_"))
    write_records(out / f"{stem}.requests.jsonl", records)
    path = out / f"{stem}.summary.json"
    path.write_text(json.dumps(asdict(summary), indent=1) + "\n")
    return path


def read_summary(path: str | Path) -> Summary:
    return Summary(**json.loads(Path(path).read_text()))

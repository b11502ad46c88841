"""PNG plots (matplotlib, Agg): throughput vs number of adapters, TTFT CDF. Skipped without matplotlib."""

from __future__ import annotations

from pathlib import Path

from perf.workload.records import RequestRecord
from perf.workload.report import Summary


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def throughput_vs_adapters(
    points: list[tuple[int, Summary]], path: str | Path, reference: dict[str, float] | None = None
) -> Path | None:
    """req/s against n; ``reference`` draws horizontal lines (e.g. base-only). None without matplotlib."""
    plt = _pyplot()
    if plt is None or not points:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [n for n, _ in points]
    ax.plot(xs, [s.req_per_s for _, s in points], marker="o", label="engine")
    for label, value in (reference or {}).items():
        ax.axhline(value, linestyle="--", linewidth=1, label=label, color="gray" if "base" in label else None)
    ax.set_xscale("log")
    ax.set_xlabel("number of adapters")
    ax.set_ylabel("throughput (req/s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def ttft_cdf(runs: dict[str, list[RequestRecord]], path: str | Path, slo_s: float | None = None) -> Path | None:
    """Empirical CDF of TTFT per run; None without matplotlib."""
    plt = _pyplot()
    if plt is None or not runs:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, records in runs.items():
        values = sorted(r.ttft for r in records if r.ttft is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
    if slo_s is not None:
        ax.axvline(slo_s, linestyle=":", color="red", linewidth=1, label=f"SLO {slo_s:g} s")
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)

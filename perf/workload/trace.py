"""S-LoRA's synthetic workload: power-law adapter popularity, Gamma arrivals, uniform lengths.

Follows S-LoRA's ``benchmarks/trace.py``: adapter id = ``int(np.random.power(alpha, n) * num_adapters)``
(``np.random.power`` draws x in [0, 1] with density ``alpha * x**(alpha - 1)``; alpha = 1 is uniform, alpha < 1
favours small ids), inter-arrival times ~ Gamma(shape = 1/cv^2, scale = cv^2/rate) (cv = 1: Poisson), prompt and
output lengths uniform in [lo, hi).

    python -m perf.workload.trace --adapters 100 --alpha 1 --rate 2 --cv 1 --duration 60 \
        --input-range 8 512 --output-range 8 512 --seed 0 --out trace.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROMPT_WORD = "Hello "  # S-LoRA's prompt: "Hello " * prompt_len


@dataclass
class WorkloadConfig:
    """Parameters of one synthetic trace.

    Attributes:
        num_adapters: adapters the requests spread over (0: every request is base-only).
        alpha: power-law exponent of np.random.power (S-LoRA sweeps 0.1, 0.3, 0.6, 1).
        rate: mean arrival rate, requests per second.
        cv: coefficient of variation of the inter-arrival times (1: Poisson).
        duration_s: the trace holds int(rate * duration_s) requests.
        input_range: prompt length uniform in [lo, hi).
        output_range: output length uniform in [lo, hi).
        base_fraction: share of requests with no adapter.
        seed: seeds every draw.
        vocab_range: token ids uniform in [lo, hi) when token ids are generated; None: no ids (text prompts).
        adapter_prefix: adapter i is named f"{adapter_prefix}{i:04d}".
    """

    num_adapters: int = 100
    alpha: float = 1.0
    rate: float = 2.0
    cv: float = 1.0
    duration_s: float = 60.0
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    base_fraction: float = 0.0
    seed: int = 0
    vocab_range: tuple[int, int] | None = None
    adapter_prefix: str = "lora-"

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.cv <= 0 or self.duration_s <= 0 or self.alpha <= 0:
            raise ValueError("rate, cv, duration_s and alpha must be > 0")
        for name in ("input_range", "output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo < hi:
                raise ValueError(f"{name} must be [lo, hi) with 1 <= lo < hi, got {(lo, hi)}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be in [0, 1], got {self.base_fraction}")

    @property
    def num_requests(self) -> int:
        return int(self.rate * self.duration_s)


@dataclass
class TraceRequest:
    """One request of a trace; arrival_s counts from the trace's start."""

    index: int
    arrival_s: float
    adapter: str | None
    prompt_len: int
    output_len: int
    prompt_ids: list[int] | None = field(default=None, repr=False)

    def prompt_text(self) -> str:
        """S-LoRA's text prompt: the word "Hello " prompt_len times."""
        return PROMPT_WORD * self.prompt_len


def adapter_name(i: int, prefix: str = "lora-") -> str:
    return f"{prefix}{i:04d}"


def power_law_ids(rng: np.random.Generator, alpha: float, num_requests: int, num_adapters: int) -> np.ndarray:
    """S-LoRA's adapter choice: int(power(alpha) * n), clipped to n - 1 (power can return exactly 1.0)."""
    ids = (rng.power(alpha, num_requests) * num_adapters).astype(np.int64)
    return np.minimum(ids, num_adapters - 1)


def gamma_arrivals(rng: np.random.Generator, rate: float, cv: float, num_requests: int) -> np.ndarray:
    """Arrival times: cumulative Gamma(1/cv^2, cv^2/rate) gaps; the first request arrives at its first gap."""
    shape, scale = 1.0 / cv**2, cv**2 / rate
    return np.cumsum(rng.gamma(shape, scale, num_requests))


def generate_trace(config: WorkloadConfig) -> list[TraceRequest]:
    """The trace for ``config``: same config, same trace."""
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    arrivals = gamma_arrivals(rng, config.rate, config.cv, n)
    ids = power_law_ids(rng, config.alpha, n, config.num_adapters) if config.num_adapters > 0 else np.zeros(n, int)
    base = rng.random(n) < config.base_fraction if config.num_adapters > 0 else np.ones(n, bool)
    prompt_lens = rng.integers(*config.input_range, size=n)
    output_lens = rng.integers(*config.output_range, size=n)
    trace = []
    for i in range(n):
        prompt_ids = None
        if config.vocab_range is not None:
            prompt_ids = rng.integers(*config.vocab_range, size=int(prompt_lens[i])).tolist()
        trace.append(
            TraceRequest(
                index=i,
                arrival_s=float(arrivals[i]),
                adapter=None if base[i] else adapter_name(int(ids[i]), config.adapter_prefix),
                prompt_len=int(prompt_lens[i]),
                output_len=int(output_lens[i]),
                prompt_ids=prompt_ids,
            )
        )
    return trace


def with_token_ids(trace: list[TraceRequest], vocab_range: tuple[int, int], seed: int = 0) -> list[TraceRequest]:
    """A copy of ``trace`` whose prompts are random token ids in [lo, hi) (seeded), lengths unchanged."""
    rng = np.random.default_rng(seed)
    return [
        TraceRequest(
            r.index,
            r.arrival_s,
            r.adapter,
            r.prompt_len,
            r.output_len,
            rng.integers(*vocab_range, size=r.prompt_len).tolist(),
        )
        for r in trace
    ]


def base_only(trace: list[TraceRequest]) -> list[TraceRequest]:
    """The same trace with every request served by the base model."""
    return [TraceRequest(r.index, r.arrival_s, None, r.prompt_len, r.output_len, r.prompt_ids) for r in trace]


def write_trace(path: str | Path, trace: list[TraceRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(asdict(r)) + "\n")
    return path


def read_trace(path: str | Path) -> list[TraceRequest]:
    with open(path) as f:
        return [TraceRequest(**json.loads(line)) for line in f if line.strip()]


def describe(trace: list[TraceRequest]) -> dict:
    """Counts a person checks before a run: requests, span, distinct adapters, mean lengths."""
    if not trace:
        return {"requests": 0}
    adapters = [r.adapter for r in trace if r.adapter]
    return {
        "requests": len(trace),
        "span_s": round(trace[-1].arrival_s, 3),
        "distinct_adapters": len(set(adapters)),
        "base_only_requests": len(trace) - len(adapters),
        "mean_prompt_len": round(float(np.mean([r.prompt_len for r in trace])), 1),
        "mean_output_len": round(float(np.mean([r.output_len for r in trace])), 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--input-range", type=int, nargs=2, default=(8, 512))
    p.add_argument("--output-range", type=int, nargs=2, default=(8, 512))
    p.add_argument("--base-fraction", type=float, default=0.0)
    p.add_argument("--vocab-range", type=int, nargs=2, default=None, help="also write random prompt token ids")
    p.add_argument("--adapter-prefix", default="lora-")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    config = WorkloadConfig(
        num_adapters=a.adapters,
        alpha=a.alpha,
        rate=a.rate,
        cv=a.cv,
        duration_s=a.duration,
        input_range=tuple(a.input_range),
        output_range=tuple(a.output_range),
        base_fraction=a.base_fraction,
        seed=a.seed,
        vocab_range=tuple(a.vocab_range) if a.vocab_range else None,
        adapter_prefix=a.adapter_prefix,
    )
    trace = generate_trace(config)
    write_trace(a.out, trace)
    print(json.dumps({"out": a.out, **describe(trace)}))


if __name__ == "__main__":
    main()

"""The capacity benchmark's requests: one fixed set per adapter count, and open-loop Poisson schedules over it.

Every target sees the same requests: request i has the same prompt token ids and output length
for every adapter count (drawn from ``seed``), and at a given adapter count the same adapter
(drawn uniformly from ``lora-0000 .. lora-{n-1}`` by a second generator seeded from ``seed`` and
n; n = 0 is the base model alone). The lengths are S-LoRA's: uniform in [lo, hi).

A schedule is a list of (request, send offset in seconds). Offline runs send everything at
offset 0; a sweep point at rate r sends a Poisson process: unit-rate exponential gaps (seeded,
the same for every rate) divided by r, kept while the offset is under the point's duration,
cycling through the request set (the k-th arrival is request k mod N).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perf.workload.trace import adapter_name


@dataclass(frozen=True)
class RequestSetConfig:
    """What the fixed request set is made of.

    Attributes:
        count: requests in the set.
        input_range: prompt length uniform in [lo, hi).
        output_range: output length uniform in [lo, hi) (served exactly: ignore_eos).
        vocab_range: prompt token ids uniform in [lo, hi).
        seed: seeds the lengths, the prompts and (with the adapter count) the adapters.
    """

    count: int = 1000
    input_range: tuple[int, int] = (8, 512)
    output_range: tuple[int, int] = (8, 512)
    vocab_range: tuple[int, int] = (4, 128256)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError(f"count must be > 0, got {self.count}")
        for name in ("input_range", "output_range", "vocab_range"):
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi:
                raise ValueError(f"{name} must be [lo, hi) with 0 <= lo < hi, got {(lo, hi)}")

    @property
    def max_model_len(self) -> int:
        """A context that holds the longest prompt plus the longest output, with a little room."""
        return self.input_range[1] + self.output_range[1] + 8


@dataclass(frozen=True)
class CapacityRequest:
    """One request of the set; ``index`` is its place in the set."""

    index: int
    prompt_ids: tuple[int, ...]
    output_len: int
    adapter: str | None


@dataclass(frozen=True)
class ScheduledRequest:
    """A request sent at ``offset_s`` after the run's start; ``index`` numbers the run's sends."""

    index: int
    offset_s: float
    request: CapacityRequest


def adapter_names(count: int) -> list[str]:
    """The names of the first ``count`` adapters of the catalogue."""
    return [adapter_name(i) for i in range(count)]


def build_requests(config: RequestSetConfig, num_adapters: int) -> list[CapacityRequest]:
    """The request set at ``num_adapters`` adapters (0: base only); same arguments, same requests."""
    if num_adapters < 0:
        raise ValueError(f"num_adapters must be >= 0, got {num_adapters}")
    rng = np.random.default_rng(config.seed)
    prompt_lens = rng.integers(*config.input_range, size=config.count)
    output_lens = rng.integers(*config.output_range, size=config.count)
    prompts = [tuple(int(t) for t in rng.integers(*config.vocab_range, size=int(n))) for n in prompt_lens]
    if num_adapters:
        choice = np.random.default_rng([config.seed, num_adapters]).integers(0, num_adapters, size=config.count)
        adapters: list[str | None] = [adapter_name(int(i)) for i in choice]
    else:
        adapters = [None] * config.count
    return [
        CapacityRequest(i, prompts[i], int(output_lens[i]), adapters[i]) for i in range(config.count)
    ]


def offline_schedule(requests: list[CapacityRequest]) -> list[ScheduledRequest]:
    """Everything at once."""
    return [ScheduledRequest(r.index, 0.0, r) for r in requests]


def poisson_offsets(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Arrival offsets of a Poisson process of ``rate`` per second over [0, duration_s).

    The unit-rate gaps depend on ``seed`` only, so two rates give the same arrivals stretched in time.
    """
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration_s must be > 0, got {rate}, {duration_s}")
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    offsets = np.empty(0)
    draw = int(expected + 10 * np.sqrt(expected) + 16)
    while offsets.size == 0 or offsets[-1] < duration_s:
        gaps = rng.exponential(1.0, draw)
        start = offsets[-1] * rate if offsets.size else 0.0
        offsets = np.concatenate([offsets, (start + np.cumsum(gaps)) / rate])
    return offsets[offsets < duration_s]


def poisson_schedule(
    requests: list[CapacityRequest], rate: float, duration_s: float, seed: int
) -> list[ScheduledRequest]:
    """Poisson arrivals at ``rate`` for ``duration_s``, cycling through ``requests``."""
    if not requests:
        raise ValueError("no requests to schedule")
    offsets = poisson_offsets(rate, duration_s, seed)
    return [ScheduledRequest(k, float(t), requests[k % len(requests)]) for k, t in enumerate(offsets)]

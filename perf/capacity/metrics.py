"""The capacity benchmark's arithmetic: records, offline and sweep-point summaries, the knee, slopes.

Plain Python and numpy (no torch, no server), unit-tested in tests/test_capacity_logic.py.

Times in records are seconds from the run's start on the CLOCK_MONOTONIC clock (time.monotonic),
which is the same clock in every process of the machine, so client processes' stamps compare.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from perf.workload.records import RequestRecord

UNFINISHED = "unfinished at the cap"  # the error of a request still running when a run's cap came (end_s None)

# The knee of a sweep, as summary.md states it.
KNEE_MIN_RATIO = 0.95
KNEE_MAX_TTFT_P99_S = 1.0
KNEE_DEFINITION = (
    f"knee = the highest offered rate whose point has achieved req/s >= {KNEE_MIN_RATIO} x the offered req/s "
    f"and TTFT p99 <= {KNEE_MAX_TTFT_P99_S:g} s; both are measured in the point's steady-state window (arrivals "
    f"after the warm-up until the last arrival: completions in the window / its length against arrivals in it "
    f"/ its length; TTFT over the requests that arrived in it, a request with no token by the end counting as "
    f"infinite); 'none' when no point qualifies"
)


@dataclass
class CapacityRecord(RequestRecord):
    """A RequestRecord with what the capacity benchmark adds.

    ``request`` is the request's index in the fixed set (``index`` numbers the run's sends: a sweep
    cycles through the set); ``output_digest`` is :func:`digest` of the output token ids (token
    identity between targets across calls, without storing the ids); ``output_ids`` only on request.
    """

    request: int = 0
    output_digest: str | None = None
    output_ids: list[int] | None = None


def digest(token_ids: Iterable[int]) -> str:
    """A short hash of a token-id sequence (same ids, same digest)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(list(token_ids), dtype=np.int64).tobytes())
    return h.hexdigest()


def percentile(values: Sequence[float], q: float) -> float | None:
    """numpy's linear-interpolation percentile, with +inf allowed (an infinite neighbour gives inf); None if empty."""
    if not len(values):
        return None
    ordered = np.sort(np.asarray(values, dtype=float))
    position = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(position), math.ceil(position)
    if math.isinf(ordered[hi]) or math.isinf(ordered[lo]):
        return math.inf if position > lo or math.isinf(ordered[lo]) else float(ordered[lo])
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo))


def inter_token_latencies(records: Iterable[RequestRecord]) -> list[float]:
    """Per-token gaps of every record: a response of k tokens after a gap g counts as k gaps of g / k."""
    return [gap for r in records for gap in r.inter_token_latencies()]


def ttfts(records: Iterable[RequestRecord]) -> list[float]:
    """TTFT of each sent record; +inf for one that never got a token."""
    return [math.inf if r.ttft is None else r.ttft for r in records if r.send_s is not None]


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else value


@dataclass
class ClientLoad:
    """CPU use of one client process over a run: cpu seconds / wall seconds (1.0 = one core busy)."""

    process: int
    cpu_s: float
    wall_s: float
    requests: int
    responses: int

    @property
    def utilization(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class OfflineResult:
    """One target at one adapter count, every request sent at once.

    req_per_s and output_tok_per_s count completed requests and their tokens over wall_s (the
    first send to the last completion, or to the cap when ``capped``); exact_length counts
    completed requests that got exactly the requested number of tokens.
    """

    target: str
    adapters: int
    requests: int
    completed: int
    exact_length: int
    failed: int
    wall_s: float
    req_per_s: float
    output_tok_per_s: float
    output_tokens: int
    capped: bool
    ttft_p50: float | None = None
    latency_p50: float | None = None
    first_error: str | None = None
    client_cpu_max: float | None = None  # the busiest client process's cpu / wall
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def summarize_offline(
    target: str,
    adapters: int,
    records: list[CapacityRecord],
    wall_s: float,
    capped: bool = False,
    clients: list[ClientLoad] | None = None,
) -> OfflineResult:
    done = [r for r in records if r.completed]
    tokens = sum(r.output_tokens for r in done)
    wall = max(wall_s, 1e-9)
    failed = [r for r in records if r.error is not None]
    return OfflineResult(
        target=target,
        adapters=adapters,
        requests=len(records),
        completed=len(done),
        exact_length=sum(1 for r in done if r.output_tokens == r.output_tokens_requested),
        failed=len(failed),
        wall_s=wall_s,
        req_per_s=len(done) / wall,
        output_tok_per_s=tokens / wall,
        output_tokens=tokens,
        capped=capped,
        ttft_p50=_finite_or_none(percentile(ttfts(records), 50)),
        latency_p50=percentile([r.latency for r in done], 50),
        first_error=next((r.error for r in failed), None),
        client_cpu_max=max((c.utilization for c in clients), default=None) if clients else None,
    )


@dataclass
class SweepPoint:
    """One offered rate of an open-loop sweep (``offered_rps`` = ``fraction`` x the target's capacity).

    The window is [warmup_s, duration_s) of the point's schedule: achieved_rps counts completions
    in it, achieved_tok_per_s the tokens received in it, offered_in_window_rps the arrivals in it,
    each over its length; TTFT and ITL are over the requests that arrived in it. overall_rps is
    completions / (last completion or the cap), for reference.
    """

    target: str
    adapters: int
    fraction: float
    offered_rps: float
    duration_s: float
    warmup_s: float
    sent: int
    completed: int
    unfinished: int
    failed: int
    offered_in_window_rps: float
    achieved_rps: float
    achieved_tok_per_s: float
    overall_rps: float
    ttft_p50: float | None
    ttft_p99: float | None  # inf (a request of the window never got a token) is written as None with ttft_inf
    ttft_inf: bool
    itl_p50: float | None
    itl_p99: float | None
    latency_p50: float | None
    send_lag_p99: float | None  # actual send - scheduled send
    meets_throughput: bool
    meets_ttft: bool
    steady: bool  # the median latency of the window's requests is under the warm-up: the window saw steady state
    first_error: str | None = None
    client_cpu_max: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def qualifies(self) -> bool:
        return self.meets_throughput and self.meets_ttft


def summarize_sweep_point(
    target: str,
    adapters: int,
    fraction: float,
    offered_rps: float,
    duration_s: float,
    warmup_s: float,
    records: list[CapacityRecord],
    end_s: float,
    clients: list[ClientLoad] | None = None,
) -> SweepPoint:
    """Summarize one point; ``end_s`` is when the run stopped (last completion or the drain cap)."""
    if not 0 <= warmup_s < duration_s:
        raise ValueError(f"warmup_s must be in [0, duration_s), got {warmup_s} for {duration_s}")
    window = duration_s - warmup_s
    in_window = [r for r in records if warmup_s <= r.arrival_s < duration_s]
    done = [r for r in records if r.completed]
    completions = sum(1 for r in done if warmup_s <= r.end_s < duration_s)
    tokens = sum(
        k for r in records for t, k in zip(r.chunk_times, r.chunk_tokens, strict=True) if warmup_s <= t < duration_s
    )
    offered_in_window = len(in_window) / window
    achieved = completions / window
    ttft = ttfts(in_window)
    p99 = percentile(ttft, 99)
    itl = inter_token_latencies([r for r in in_window if r.completed])
    latencies = [r.latency if r.completed else math.inf for r in in_window]
    latency_p50 = percentile(latencies, 50)
    lags = [r.send_s - r.arrival_s for r in records if r.send_s is not None]
    failed = [r for r in records if r.error is not None]
    return SweepPoint(
        target=target,
        adapters=adapters,
        fraction=fraction,
        offered_rps=offered_rps,
        duration_s=duration_s,
        warmup_s=warmup_s,
        sent=sum(1 for r in records if r.send_s is not None),
        completed=len(done),
        unfinished=sum(1 for r in records if r.send_s is not None and r.end_s is None),
        failed=sum(1 for r in failed if r.error != UNFINISHED),
        offered_in_window_rps=offered_in_window,
        achieved_rps=achieved,
        achieved_tok_per_s=tokens / window,
        overall_rps=len(done) / max(end_s, 1e-9),
        ttft_p50=_finite_or_none(percentile(ttft, 50)),
        ttft_p99=_finite_or_none(p99),
        ttft_inf=p99 is not None and math.isinf(p99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
        latency_p50=_finite_or_none(latency_p50),
        send_lag_p99=percentile(lags, 99),
        meets_throughput=bool(in_window) and achieved >= KNEE_MIN_RATIO * offered_in_window,
        meets_ttft=p99 is not None and p99 <= KNEE_MAX_TTFT_P99_S,
        steady=latency_p50 is not None and latency_p50 < warmup_s,
        first_error=next((r.error for r in failed if r.error != UNFINISHED), None),
        client_cpu_max=max((c.utilization for c in clients), default=None) if clients else None,
    )


def find_knee(points: Iterable[SweepPoint]) -> float | None:
    """The highest offered rate among qualifying points (KNEE_DEFINITION); None when none qualifies."""
    rates = [p.offered_rps for p in points if p.qualifies]
    return max(rates) if rates else None


def knee_notes(points: list[SweepPoint]) -> list[str]:
    """Caveats a reader needs next to the knee: a lower rate failing, points that never reached steady state."""
    notes = []
    knee = find_knee(points)
    if knee is not None:
        below = [p for p in points if p.offered_rps < knee and not p.qualifies]
        if below:
            rates = ", ".join(f"{p.offered_rps:.3g}" for p in below)
            notes.append(f"not monotone: lower offered rates failed the criteria ({rates} req/s)")
    unsteady = [p for p in points if not p.steady]
    if unsteady:
        rates = ", ".join(f"{p.offered_rps:.3g}" for p in unsteady)
        notes.append(
            f"median latency >= the warm-up at {rates} req/s: the window may not have reached steady state "
            f"(achieved req/s biased low); lengthen --sweep-duration / --sweep-warmup"
        )
    return notes


def linear_slope(times: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of values against times (units of value per unit of time); None under 2 points."""
    if len(times) < 2 or len(set(times)) < 2:
        return None
    slope, _ = np.polyfit(np.asarray(times, dtype=float), np.asarray(values, dtype=float), 1)
    return float(slope)

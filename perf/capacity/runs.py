"""Runs of the capacity benchmark, the same for every target: offline (everything at once) and a rate sweep.

A target is a :class:`Driver`: it sends a schedule (request, offset) open-loop and returns one
:class:`~perf.capacity.metrics.CapacityRecord` per send. The in-process engine
(perf/capacity/engine.py) and the server through the client processes (perf/capacity/clients.py)
are drivers; the functions here turn their runs into results and per-request JSONL files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from perf.capacity.metrics import (
    CapacityRecord,
    ClientLoad,
    OfflineResult,
    SweepPoint,
    summarize_offline,
    summarize_sweep_point,
)
from perf.capacity.requests import CapacityRequest, ScheduledRequest, offline_schedule, poisson_schedule


@dataclass
class SweepConfig:
    """The open-loop sweep of one target.

    Attributes:
        fractions: offered rates as fractions of the target's measured offline capacity (req/s).
        duration_s: arrivals of each point span this long.
        warmup_s: the point's first seconds, left out of its steady-state window.
        drain_s: after the last arrival, how long the point may take to finish; then what runs is cancelled.
        seed: seeds the Poisson gaps (the same for every rate and target).
        pause_s: idle time between points.
    """

    fractions: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 1.0, 1.2)
    duration_s: float = 45.0
    warmup_s: float = 15.0
    drain_s: float = 20.0
    seed: int = 1
    pause_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.fractions or any(f <= 0 for f in self.fractions):
            raise ValueError(f"fractions must be > 0, got {self.fractions}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}, {self.duration_s}")


@dataclass(frozen=True)
class Budget:
    """The call's time budget: ``deadline`` on time.monotonic() (the same clock in every process)."""

    deadline: float
    min_run_s: float = 20.0  # a run with less time than this left is not started

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether a run of ``seconds`` ends before the deadline."""
        return self.remaining() >= max(seconds, self.min_run_s)

    def cap(self, seconds: float) -> float:
        """``seconds``, or what is left of the budget if less."""
        return max(0.0, min(seconds, self.remaining()))


@dataclass
class RunOutcome:
    """What a driver's run gave: one record per send, when it ended, whether the cap ended it, the clients' load."""

    records: list[CapacityRecord]
    end_s: float
    capped: bool
    clients: list[ClientLoad] = field(default_factory=list)


class Driver(Protocol):
    """A target that sends a schedule open-loop (send times never wait for completions)."""

    def run(self, schedule: list[ScheduledRequest], *, cap_s: float, keep_ids: bool) -> RunOutcome:
        """Send each request at its offset from the run's start; return when every request ended or at
        ``cap_s`` seconds from the start (what still runs is cancelled and recorded as UNFINISHED)."""
        ...


def log(message: str) -> None:
    """A progress line of the capacity benchmark's parent process."""
    print(f"[capacity {time.strftime('%H:%M:%S')}] {message}", flush=True)


def new_record(item: ScheduledRequest) -> CapacityRecord:
    """An empty record of one scheduled send."""
    r = item.request
    return CapacityRecord(
        index=item.index,
        adapter=r.adapter,
        prompt_tokens=len(r.prompt_ids),
        output_tokens_requested=r.output_len,
        arrival_s=item.offset_s,
        request=r.index,
    )


def run_name(target: str, adapters: int, fraction: float | None = None) -> str:
    """File stem of a run: engine_n100_offline, server_stream_n100_x0.90."""
    return f"{target}_n{adapters}_" + ("offline" if fraction is None else f"x{fraction:.2f}")


def _microseconds(value):
    """Times rounded to 1 us: the files shrink by half and lose nothing a clock here resolves."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list) and value and isinstance(value[0], float):
        return [round(v, 6) for v in value]
    return value


def write_records(path: Path, records: list[CapacityRecord]) -> Path:
    """One JSON object a line (the record's fields; times in seconds from the run's start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({k: _microseconds(v) for k, v in asdict(r).items()}) + "\n")
    return path


def measure_offline(
    driver: Driver,
    target: str,
    adapters: int,
    requests: list[CapacityRequest],
    *,
    cap_s: float,
    keep_ids: bool,
    runs_dir: Path,
) -> tuple[OfflineResult, list[CapacityRecord]]:
    """Every request at once; the throughput of the whole run."""
    started = time.time()
    outcome = driver.run(offline_schedule(requests), cap_s=cap_s, keep_ids=keep_ids)
    result = summarize_offline(target, adapters, outcome.records, outcome.end_s, outcome.capped, outcome.clients)
    result.meta["clients"] = [asdict(c) for c in outcome.clients]
    result.meta["window"] = [started, time.time()]  # epoch seconds, for what the GPU did meanwhile (gpu_clock.py)
    if outcome.capped:
        result.notes.append(f"capped at {cap_s:g} s: throughput counts what completed by then")
    write_records(runs_dir / f"{run_name(target, adapters)}.jsonl", outcome.records)
    return result, outcome.records


def measure_sweep_point(
    driver: Driver,
    target: str,
    adapters: int,
    requests: list[CapacityRequest],
    capacity_rps: float,
    fraction: float,
    config: SweepConfig,
    runs_dir: Path,
) -> SweepPoint:
    """One open-loop point at ``fraction`` x ``capacity_rps``."""
    rate = fraction * capacity_rps
    schedule = poisson_schedule(requests, rate, config.duration_s, config.seed)
    outcome = driver.run(schedule, cap_s=config.duration_s + config.drain_s, keep_ids=False)
    point = summarize_sweep_point(
        target, adapters, fraction, rate, config.duration_s, config.warmup_s, outcome.records, outcome.end_s,
        outcome.clients,
    )
    write_records(runs_dir / f"{run_name(target, adapters, fraction)}.jsonl", outcome.records)
    time.sleep(config.pause_s)
    return point

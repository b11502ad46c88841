"""Replay a trace at its arrival times against a target; collect one RequestRecord per request.

A timer thread sends each request when its arrival time comes (send never blocks: targets
are asynchronous); targets fill the record from their own callback threads through the
:class:`Clock` and call :meth:`Tracker.finish` once per request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from perf.workload.records import RequestRecord
from perf.workload.trace import TraceRequest


class Clock:
    """Seconds since the replay started (perf_counter based)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


class Tracker:
    """Counts finished requests; wakes the replay when all that were sent are done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.sent = 0
        self.finished = 0
        self.on_finish = None  # optional callable, e.g. a progress bar's update

    def started(self) -> None:
        with self._lock:
            self.sent += 1

    def finish(self, record: RequestRecord, t: float, error: str | None = None) -> None:
        with self._lock:
            if record.end_s is not None or (record.error is not None and error is not None):
                return  # finished once already
            record.end_s = t
            if error is not None:
                record.error = error
            self.finished += 1
            self._cond.notify_all()
        if self.on_finish is not None:
            self.on_finish()

    def wait_all(self, total: int, deadline: float | None) -> bool:
        """Wait until ``total`` requests finished or perf_counter passes deadline; True if all did."""
        with self._cond:
            while self.finished < total:
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
            return True


class Target(Protocol):
    """A system under test. send() must return at once; the request's end comes through tracker."""

    name: str

    def send(self, request: TraceRequest, record: RequestRecord, clock: Clock, tracker: Tracker) -> None: ...

    def close(self) -> None: ...


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    wall_s: float  # from the start until the last request ended, or until the cap
    capped: bool  # the cap ended the replay with requests unsent or unfinished


def _progress(total: int, label: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (not on every machine)
        return None
    return tqdm(total=total, desc=label, unit="req", leave=False, mininterval=1.0)


def replay(
    trace: list[TraceRequest], target: Target, *, max_duration_s: float | None = None, progress: bool = True
) -> ReplayResult:
    """Send every request at its arrival time; wait for all (or until max_duration_s from the start).

    Requests whose arrival falls after the cap are not sent; requests still running at the cap
    are recorded with error "unfinished at the cap".
    """
    records = [
        RequestRecord(
            index=r.index,
            adapter=r.adapter,
            prompt_tokens=r.prompt_len,
            output_tokens_requested=r.output_len,
            arrival_s=r.arrival_s,
        )
        for r in trace
    ]
    tracker = Tracker()
    bar = _progress(len(trace), target.name, progress)
    if bar is not None:
        tracker.on_finish = lambda: bar.update(1)
    clock = Clock()
    deadline = None if max_duration_s is None else clock.t0 + max_duration_s
    stop = threading.Event()

    def sender() -> None:
        for req, rec in zip(trace, records, strict=True):
            if max_duration_s is not None and req.arrival_s >= max_duration_s:
                break
            delay = req.arrival_s - clock.now()
            if delay > 0 and stop.wait(delay):
                break
            rec.send_s = clock.now()
            tracker.started()
            try:
                target.send(req, rec, clock, tracker)
            except Exception as e:  # noqa: BLE001 - a refused request is a result, not a crash
                tracker.finish(rec, clock.now(), f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=sender, name="trace-sender", daemon=True)
    thread.start()
    try:
        thread.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        all_sent = not thread.is_alive()
        stop.set()
        thread.join()
        done = tracker.wait_all(tracker.sent, deadline)
        end_times = [r.end_s for r in records if r.end_s is not None]
        wall = max(end_times) if (done and all_sent and end_times) else clock.now()
        if not done:
            for r in records:
                if r.send_s is not None and r.end_s is None:
                    r.error = "unfinished at the cap"
        capped = not (done and all_sent and tracker.sent == len(trace))
    finally:
        stop.set()
        if bar is not None:
            bar.close()
    return ReplayResult(records=records, wall_s=wall, capped=capped)

"""Outputs handed to their requests' emit callbacks on threads of their own, merged while they wait.

The engine process's receiver thread must keep reading the pipe: if it called the emit callbacks itself, a slow
consumer (a Triton response sender crossing into the server for each response, an ensemble step behind it) would
fill the pipe and stall the engine's step loop on its next send. So the receiver only puts outputs here; delivery
threads call the callbacks. While a request's outputs wait, consecutive ones merge into one
(manylora.engine.requests.coalesce): when the response path falls behind, chunks grow instead of queueing, and a
request's text is the same either way. A request's outputs are delivered in order, by one thread at a time;
requests are served in the order their waiting outputs arrived.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

from manylora.engine.requests.coalesce import merge_outputs
from manylora.engine.requests.types import GenerationOutput

log = logging.getLogger("manylora.engine")

DELIVERY_THREADS = 4  # responses in flight at once across requests (a Triton send waits for the server)


class OutputDelivery:
    """put() from any thread; ``deliver(request_id, output)`` runs on one of ``threads`` delivery threads."""

    def __init__(self, deliver: Callable[[str, GenerationOutput], None], threads: int = DELIVERY_THREADS,
                 name: str = "manylora-delivery") -> None:
        if threads < 1:
            raise ValueError(f"delivery needs at least one thread, got {threads}")
        self._deliver = deliver
        self._pending: dict[str, list[GenerationOutput]] = {}  # insertion order: first waiting output first
        self._busy: set[str] = set()  # requests a thread is delivering now
        self._cond = threading.Condition()
        self._closed = False
        self.merged = 0  # outputs that went out inside another
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def put(self, request_id: str, output: GenerationOutput) -> None:
        with self._cond:
            waiting = self._pending.get(request_id)
            if waiting is None:
                self._pending[request_id] = [output]
            else:
                merged = merge_outputs(waiting[-1], output)
                if merged is None:
                    waiting.append(output)
                else:
                    waiting[-1] = merged
                    self.merged += 1
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what waits, then stop the threads (within ``timeout`` seconds in all)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _next(self) -> tuple[str, list[GenerationOutput]] | None:
        """The first waiting request no other thread is delivering, and its outputs; None once closed and empty."""
        with self._cond:
            while True:
                request_id = next((rid for rid in self._pending if rid not in self._busy), None)
                if request_id is not None:
                    self._busy.add(request_id)
                    return request_id, self._pending.pop(request_id)
                if self._closed and not self._pending:
                    return None
                self._cond.wait()

    def _run(self) -> None:
        while (item := self._next()) is not None:
            request_id, outputs = item
            try:
                for output in outputs:
                    try:
                        self._deliver(request_id, output)
                    except Exception:  # noqa: BLE001 - one request's callback must not stop the others
                        log.error("request %s: delivering an output failed:\n%s", request_id,
                                  traceback.format_exc())
            finally:
                with self._cond:
                    self._busy.discard(request_id)
                    self._cond.notify_all()

"""The lock between the engine loop and the threads that read its state (metrics, admin requests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class LoopStateLock:
    """The engine loop holds this lock for each iteration; other threads read the engine's state between two.

    A bare lock starves those readers: the loop re-takes it microseconds after releasing it, well before a
    blocked reader wakes up, so on a busy CPU-bound engine a metrics scrape could wait out dozens of steps.
    Readers announce themselves here, and the loop, after an iteration, steps aside briefly (``handoff_s``)
    when one is waiting; with no reader waiting it costs one integer test per iteration.
    """

    def __init__(self, handoff_s: float = 2e-4) -> None:
        self._lock = threading.RLock()  # re-entrant: a callback inside an iteration may read the stats
        self._count_lock = threading.Lock()
        self._waiting = 0
        self.handoff_s = handoff_s

    @contextmanager
    def iteration(self) -> Iterator[None]:
        """Held by the loop for one iteration; on leaving, lets a waiting reader in before the next."""
        with self._lock:
            yield
        if self._waiting:
            time.sleep(self.handoff_s)  # releases the GIL; the reader blocked on the lock takes it now

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Held by another thread while it reads the loop's state."""
        with self._count_lock:
            self._waiting += 1
        try:
            with self._lock:
                yield
        finally:
            with self._count_lock:
                self._waiting -= 1

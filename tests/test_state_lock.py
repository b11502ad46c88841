"""LoopStateLock: a reader gets in between the loop's iterations instead of waiting out the loop."""

import threading
import time

from manylora.engine.scheduling.state_lock import LoopStateLock


def _busy(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:  # holds the GIL, as a CPU-bound engine step does
        pass


def test_a_reader_gets_in_between_iterations_of_a_busy_loop():
    """200 iterations of 0.5 ms of Python each; a reader in a loop of its own must get in at least 100 times.
    With the loop taking the bare lock instead (no handoff), this reader got in once in 300 iterations on the
    development machine: the loop re-takes the lock before the blocked reader wakes."""
    lock = LoopStateLock()
    done = threading.Event()
    reads = 0

    def loop() -> None:
        for _ in range(200):
            with lock.iteration():
                _busy(5e-4)
        done.set()

    def reader() -> None:
        nonlocal reads
        while not done.is_set():
            with lock.reading():
                reads += 1

    threads = [threading.Thread(target=loop), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert reads >= 100, reads


def test_the_loop_does_not_wait_when_no_reader_is_waiting():
    lock = LoopStateLock(handoff_s=1.0)
    start = time.perf_counter()
    for _ in range(5):
        with lock.iteration():
            pass
    assert time.perf_counter() - start < 1.0
    with lock.reading(), lock.reading():  # re-entrant for the loop's own thread, and the count returns to zero
        pass
    start = time.perf_counter()
    with lock.iteration():
        pass
    assert time.perf_counter() - start < 1.0

"""Where the engine loop's time goes (manylora/engine/scheduling/loop_times.py): steps, the on_iteration hook (the
engine process's sends to the server) and waiting, which sum to the loop's wall time."""

from __future__ import annotations

import random
import threading
import time

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.loop_times import LoopTimes
from model_factory import make_base


def test_each_pass_goes_to_step_or_idle_by_whether_it_stepped_and_its_hook_and_wait_apart():
    rng = random.Random()
    times, step, hook, idle = LoopTimes(), 0.0, 0.0, 0.0
    for _ in range(rng.randrange(50, 500)):
        stepped, iteration, hooked, waited = rng.random() < 0.5, rng.uniform(0, 0.05), rng.uniform(0, 0.01), \
            rng.uniform(0, 0.05)
        times.add(stepped, iteration, hooked, waited)
        step += iteration if stepped else 0.0
        idle += waited + (0.0 if stepped else iteration)
        hook += hooked
    stats = times.stats()
    assert stats["loop_step_seconds"] == pytest.approx(step, abs=1e-5)
    assert stats["loop_hook_seconds"] == pytest.approx(hook, abs=1e-5)
    assert stats["loop_idle_seconds"] == pytest.approx(idle, abs=1e-5)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("loop_times") / "base", "llama", seed=5)


HOOK_S = 0.003  # what the test's hook takes each pass


def test_an_engine_reports_its_loops_time_by_where_it_went(base):
    """Requests run (step time grows), then the engine idles (only idle and hook time grow); the hook's own
    seconds are counted as the hook's, and the three sum to the loop's wall time."""
    calls = [0]
    lock = threading.Lock()

    def hook():
        time.sleep(HOOK_S)
        with lock:
            calls[0] += 1

    started = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=str(base), max_num_seqs=4, max_model_len=128), on_iteration=hook)
    running = time.perf_counter()  # the loop starts at the end of the constructor
    rng = random.Random()
    done = threading.Event()
    finished = []

    def emit(out):
        if out.finished:
            finished.append(out.request_id)
            if len(finished) == 6:
                done.set()
    try:
        for i in range(6):
            engine.submit(GenerationRequest(f"r{i}", [0] + [rng.randrange(2, 290) for _ in range(5)],
                                            sampling=SamplingParams(max_tokens=rng.randrange(20, 40), ignore_eos=True)),
                          emit)
        assert done.wait(120), "the requests did not finish"
        time.sleep(0.2)  # the loop is idle from here
        busy, busy_calls = engine.stats(), calls[0]
        time.sleep(1.0)
        idle, idle_calls, read = engine.stats(), calls[0], time.perf_counter()
    finally:
        engine.shutdown()
    assert busy["loop_step_seconds"] > 0
    assert idle["loop_step_seconds"] == busy["loop_step_seconds"]  # no step ran while it idled
    hook_delta = idle["loop_hook_seconds"] - busy["loop_hook_seconds"]
    assert HOOK_S * (idle_calls - busy_calls - 1) <= hook_delta <= (HOOK_S + 0.05) * (idle_calls - busy_calls + 1)
    total = sum(idle[k] for k in ("loop_step_seconds", "loop_hook_seconds", "loop_idle_seconds"))
    # the pass under way at the reading is not yet counted (at most a 50 ms wait and a hook)
    assert read - running - 0.1 <= total <= read - started

"""Heartbeats (manylora/engine/scheduling/heartbeats.py): a silent running request always gets one; the waiting
requests share a bounded number a second, the longest silent first, so a long queue cannot flood the text path."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import CANCEL_POLL_S, Engine
from manylora.engine.scheduling.heartbeats import WAITING_HEARTBEATS_PER_S, due_heartbeats
from model_factory import make_base


@dataclass
class _Seq:
    keepalive_s: float | None
    last_output_at: float


def test_every_silent_running_request_and_the_longest_silent_waiting_ones_are_chosen():
    rng = random.Random()
    for _ in range(200):
        now = rng.uniform(100, 200)

        running, waiting = (
            [_Seq(rng.choice([None, 0.25, 1.0]), now - rng.uniform(0, 2)) for _ in range(rng.randrange(0, count))]
            for count in (30, 300))
        budget = rng.randrange(0, 40)
        chosen = due_heartbeats(running, waiting, now, budget)
        due = [s for s in running + waiting if s.keepalive_s is not None and now - s.last_output_at >= s.keepalive_s]
        assert all(s in due for s in chosen)
        assert [s for s in chosen if s in running] == [s for s in running if s in due]  # every silent running one
        chosen_waiting = [s for s in chosen if s in waiting]
        due_waiting = [s for s in waiting if s in due]
        assert len(chosen_waiting) == min(budget, len(due_waiting))
        if chosen_waiting and len(chosen_waiting) < len(due_waiting):  # none left out was silent for longer
            latest_chosen = max(s.last_output_at for s in chosen_waiting)
            assert all(s.last_output_at >= latest_chosen for s in due_waiting if s not in chosen_waiting)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("heartbeats") / "base", "llama", seed=11)


def test_a_long_queue_gets_no_more_heartbeats_than_its_share(base):
    """100 keepalive requests wait behind long ones (one running at a time): while they wait, the engine sends them
    at most WAITING_HEARTBEATS_PER_S a second (each would otherwise get one every keepalive_s, 250 a second here),
    and every output they get while waiting is a heartbeat."""
    # each pass of the loop takes at least 2 ms (its hook sleeps), so the long requests' 2,000 steps outlast the check
    # on a machine of any speed (a fast one ran them in under the check's 1.8 s)
    engine = Engine(EngineConfig(model_dir=str(base), max_num_seqs=1, max_model_len=256),
                    on_iteration=lambda: time.sleep(0.002))
    outputs: dict[str, list] = {}
    lock = threading.Lock()

    def collect(request_id):
        def emit(out):
            with lock:
                outputs.setdefault(request_id, []).append((time.perf_counter(), out))
        return emit

    rng = random.Random()
    try:
        for i in range(8):  # about 2,000 steps one after another: over 4 s of waiting for the rest
            prompt = [0] + [rng.randrange(2, 290) for _ in range(4)]
            engine.submit(GenerationRequest(f"long{i}", prompt, sampling=SamplingParams(max_tokens=250,
                                                                                      ignore_eos=True)),
                          collect(f"long{i}"))
        waiting = [f"q{i}" for i in range(100)]
        for request_id in waiting:
            engine.submit(GenerationRequest(request_id, [0, rng.randrange(2, 290)], keepalive_s=0.25,
                                            sampling=SamplingParams(max_tokens=1)), collect(request_id))
        time.sleep(0.3)  # every waiting request is past its keepalive
        start, before = time.perf_counter(), engine.stats()["heartbeats"]
        time.sleep(1.5)
        end, stats = time.perf_counter(), engine.stats()
        assert stats["waiting"] >= len(waiting), "the long requests ended too soon for the check"
    finally:
        engine.shutdown()
    polls = (end - start) / CANCEL_POLL_S + 1
    sent = stats["heartbeats"] - before
    share = round(WAITING_HEARTBEATS_PER_S * CANCEL_POLL_S) * polls
    print(f"{sent} heartbeats in {end - start:.2f} s; the waiting requests' share {share:.0f}")
    assert 0 < sent <= share
    with lock:
        beats = [t for rid in waiting for t, out in outputs.get(rid, []) if start <= t <= end]
        assert all(out.heartbeat for rid in waiting for t, out in outputs.get(rid, []) if t <= end)
    assert len(beats) == sent  # the long requests have no keepalive: the counter counts the waiting ones' beats

"""perf/engine/bench_host_step.py drives the engine's own decode path (scheduling, gathering, the decode graphs'
input buffers, sampling): a short run on the CPU must keep every sequence decoding and give a time."""

import math

from perf.engine.bench_host_step import measure


def test_a_short_run_times_decode_steps_of_every_sequence():
    ms = measure(seqs=12, steps=8, seed=3)
    assert math.isfinite(ms) and ms > 0

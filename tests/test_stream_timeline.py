"""perf/engine/stream_timeline.py: a step's wall time cut into base work, LoRA work alone and gaps."""

import random

import pytest

from perf.engine.stream_timeline import KernelEvent, kernel_events, split_step_time


def _chrome(events):
    return {"traceEvents": [{"ph": "X", "cat": "kernel", "name": e.name, "ts": e.start_us,
                             "dur": e.end_us - e.start_us, "tid": 99, "args": {"stream": e.stream}} for e in events]
            + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "tid": 1}]}


def test_a_wait_for_lora_work_is_charged_to_the_kernel_that_waited_whatever_the_streams():
    # base: gemm 0-10, norm 14-16; LoRA: shrink 1-3, expand 3-13 -> 10..13 LoRA only, 13..14 nothing runs; the
    # expand on the GEMM's stream, as a graph may map it
    events = [KernelEvent("gemm", 0, 10, 7), KernelEvent("norm", 14, 16, 7),
              KernelEvent("_lora_shrink_bgmv_kernel", 1, 3, 20), KernelEvent("_lora_expand_bgmv_kernel", 3, 13, 7)]
    split = split_step_time(kernel_events(_chrome(events)))
    assert split.wall_ms == pytest.approx(16e-3)
    assert split.main_ms == pytest.approx(12e-3)
    assert split.side_only_ms == pytest.approx(3e-3)
    assert split.idle_ms == pytest.approx(1e-3)
    assert split.side_kernel_ms == pytest.approx(12e-3)
    assert split.waits_ms == {"norm": pytest.approx(3e-3)}


def test_the_parts_add_up_to_the_wall_time_on_random_traces():
    rng = random.Random()
    for _ in range(50):
        events, t = [], 0.0
        for i in range(rng.randint(1, 30)):  # a chain of base work with gaps
            t += rng.uniform(0, 3)
            d = rng.uniform(0.5, 20)
            events.append(KernelEvent(f"k{i}", t, t + d, rng.randint(1, 3)))
            t += d
        main_total = sum(e.end_us - e.start_us for e in events)
        for i in range(rng.randint(0, 20)):  # LoRA kernels anywhere, on any stream
            s = rng.uniform(0, t + 10)
            events.append(KernelEvent(f"lora_{i}", s, s + rng.uniform(0.1, main_total / 40), rng.randint(1, 3)))
        steps = rng.randint(1, 5)
        split = split_step_time(events, steps)
        assert split.main_ms == pytest.approx(main_total / 1e3 / steps)
        assert split.main_ms + split.side_only_ms + split.idle_ms == pytest.approx(split.wall_ms)
        assert sum(split.waits_ms.values()) == pytest.approx(split.side_only_ms)
        assert 0 <= split.side_only_ms <= split.side_kernel_ms + 1e-9


def test_a_trace_without_gpu_activity_is_an_error():
    with pytest.raises(ValueError, match="no GPU activity"):
        split_step_time(kernel_events({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1}]}))

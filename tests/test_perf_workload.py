"""S-LoRA's workload generator: reproducible, power-law skew, Gamma arrivals, lengths, JSONL."""

from __future__ import annotations

import numpy as np
import pytest

from perf.workload.trace import WorkloadConfig, base_only, generate_trace, read_trace, with_token_ids, write_trace


def _ids(trace, prefix="lora-"):
    return np.array([int(r.adapter[len(prefix):]) for r in trace])


def test_same_seed_same_trace_other_seed_other_trace():
    cfg = WorkloadConfig(num_adapters=10, rate=5, duration_s=20, seed=3, vocab_range=(4, 100))
    assert generate_trace(cfg) == generate_trace(cfg)
    assert generate_trace(cfg) != generate_trace(WorkloadConfig(num_adapters=10, rate=5, duration_s=20, seed=4))


def test_power_law_direction():
    """np.random.power(alpha): alpha < 1 puts most requests on the small ids; alpha = 1 is uniform."""
    n = 10
    skewed = np.bincount(_ids(generate_trace(WorkloadConfig(num_adapters=n, alpha=0.3, rate=100, duration_s=200))),
                         minlength=n)
    assert skewed[0] > 3 * skewed[-1]
    ranks = np.argsort(np.argsort(skewed))
    assert np.corrcoef(np.arange(n), ranks)[0, 1] < -0.9  # decreasing on average (rank correlation)
    uniform = np.bincount(_ids(generate_trace(WorkloadConfig(num_adapters=n, alpha=1.0, rate=100, duration_s=200))),
                          minlength=n)
    assert uniform.min() > 0.8 * uniform.mean() and uniform.max() < 1.2 * uniform.mean()
    assert _ids(generate_trace(WorkloadConfig(num_adapters=n, alpha=0.1, rate=50, duration_s=20))).max() < n


@pytest.mark.parametrize("cv", [1.0, 2.0])
def test_gamma_arrivals_mean_and_cv(cv):
    rate = 4.0
    trace = generate_trace(WorkloadConfig(num_adapters=5, rate=rate, cv=cv, duration_s=5000, seed=1))
    gaps = np.diff([0.0] + [r.arrival_s for r in trace])
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate * cv
    assert abs(gaps.std() / gaps.mean() - cv) < 0.08 * cv
    assert np.all(gaps >= 0)


def test_lengths_ids_and_base_fraction():
    cfg = WorkloadConfig(num_adapters=3, rate=50, duration_s=40, input_range=(8, 20), output_range=(5, 9),
                         base_fraction=0.25, vocab_range=(4, 50))
    trace = generate_trace(cfg)
    assert len(trace) == 2000
    assert all(8 <= r.prompt_len < 20 and 5 <= r.output_len < 9 for r in trace)
    assert {r.prompt_len for r in trace} == set(range(8, 20))
    assert all(len(r.prompt_ids) == r.prompt_len and all(4 <= t < 50 for t in r.prompt_ids) for r in trace)
    base = sum(r.adapter is None for r in trace) / len(trace)
    assert 0.2 < base < 0.3
    assert trace[0].prompt_text() == "Hello " * trace[0].prompt_len
    assert all(r.adapter is None for r in base_only(trace))
    assert all(r.adapter is None for r in generate_trace(WorkloadConfig(num_adapters=0, rate=5, duration_s=2)))


def test_jsonl_round_trip(tmp_path):
    trace = with_token_ids(generate_trace(WorkloadConfig(num_adapters=4, rate=10, duration_s=3)), (4, 30), seed=2)
    assert read_trace(write_trace(tmp_path / "t.jsonl", trace)) == trace


def test_cli(tmp_path):
    from perf.workload.trace import main

    out = tmp_path / "trace.jsonl"
    main(["--adapters", "7", "--rate", "3", "--duration", "10", "--input-range", "8", "16", "--out", str(out)])
    trace = read_trace(out)
    assert len(trace) == 30 and all(r.prompt_ids is None and 8 <= r.prompt_len < 16 for r in trace)


def test_bad_config():
    with pytest.raises(ValueError):
        WorkloadConfig(input_range=(10, 10))
    with pytest.raises(ValueError):
        WorkloadConfig(rate=0)

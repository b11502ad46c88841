"""The capacity benchmark's pure logic on fresh random inputs: percentiles, ITL, Poisson schedules, the request set,
sweep-point windows, the knee, slopes, memory summaries, the results store. No server, no engine.

Each test draws a new seed (printed in its failure message) so that repeated runs cover new inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# `pytest` started as a script does not put the repository on sys.path (`python -m pytest` does)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.capacity.metrics import (
    KNEE_MAX_TTFT_P99_S,
    UNFINISHED,
    CapacityRecord,
    SweepPoint,
    digest,
    find_knee,
    inter_token_latencies,
    knee_notes,
    linear_slope,
    percentile,
    summarize_offline,
    summarize_sweep_point,
)
from perf.capacity.report import offline_rows, offline_table, sweeps, token_identity
from perf.capacity.requests import (
    CapacityRequest,
    RequestSetConfig,
    build_requests,
    poisson_offsets,
    poisson_schedule,
)
from perf.capacity.runs import Budget
from perf.capacity.soak import process_label, process_tree, rss_bytes, summarize_memory
from perf.capacity.store import Store, merge_stores


class SeededRng:
    """A numpy Generator that remembers its seed (for failure messages)."""

    def __init__(self, seed: int) -> None:
        self.seed_value = seed
        self._generator = np.random.default_rng(seed)

    def __getattr__(self, name: str):
        return getattr(self._generator, name)


@pytest.fixture
def rng() -> SeededRng:
    return SeededRng(int.from_bytes(os.urandom(4), "little"))


def _record(i: int, arrival: float, send: float | None, chunks: list[tuple[float, int]], end: float | None,
            requested: int | None = None, error: str | None = None) -> CapacityRecord:
    tokens = sum(k for _, k in chunks)
    r = CapacityRecord(index=i, adapter=None, prompt_tokens=4, output_tokens_requested=requested or tokens,
                       arrival_s=arrival, send_s=send, request=i)
    for t, k in chunks:
        r.add_chunk(t, k)
    r.end_s, r.error = end, error
    return r


# -- percentiles and ITL -----------------------------------------------------------------------------------------------


def test_percentile_matches_numpy_on_finite_values(rng):
    for _ in range(50):
        values = rng.exponential(rng.uniform(0.01, 5), size=int(rng.integers(1, 400))).tolist()
        for q in (0, 1, 37.5, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12), rng.seed_value


def test_percentile_with_requests_that_never_got_a_token(rng):
    n = int(rng.integers(200, 1000))
    values = rng.uniform(0.01, 1, n).tolist()
    missing = int(rng.integers(int(0.02 * n) + 1, n // 4))
    with_inf = values[: n - missing] + [math.inf] * missing
    assert percentile(with_inf, 99) == math.inf, rng.seed_value
    assert percentile(with_inf, 50) == pytest.approx(float(np.percentile(values[: n - missing] + [10.0] * missing, 50)))
    assert percentile([], 50) is None and percentile([math.inf], 50) == math.inf


def test_itl_is_the_gap_over_the_tokens_of_the_later_response(rng):
    for _ in range(50):
        chunks, t = [], 0.0
        for _ in range(int(rng.integers(1, 30))):
            t += float(rng.exponential(0.05))
            chunks.append((t, int(rng.integers(1, 6))))
        r = _record(0, 0.0, 0.0, chunks, t)
        itl = inter_token_latencies([r])
        assert len(itl) == sum(k for _, k in chunks[1:]), rng.seed_value
        assert sum(itl) == pytest.approx(chunks[-1][0] - chunks[0][0]), rng.seed_value
        expected = [(b[0] - a[0]) / b[1] for a, b in zip(chunks, chunks[1:], strict=False) for _ in range(b[1])]
        assert itl == pytest.approx(expected), rng.seed_value


def test_digest_is_token_identity():
    assert digest([1, 2, 3]) == digest(np.array([1, 2, 3], dtype=np.int32))
    assert digest([1, 2, 3]) != digest([1, 2, 4]) and digest([1, 2]) != digest([1, 2, 0])


# -- requests and schedules --------------------------------------------------------------------------------------------


def test_request_set_is_the_same_for_every_adapter_count(rng):
    seed = int(rng.integers(0, 2**31))
    config = RequestSetConfig(count=int(rng.integers(20, 300)), input_range=(8, 512), output_range=(8, 512),
                              vocab_range=(4, 1000), seed=seed)
    base = build_requests(config, 0)
    assert base == build_requests(config, 0)
    assert all(r.adapter is None for r in base)
    for n in (1, 5, int(rng.integers(2, 2000))):
        with_adapters = build_requests(config, n)
        assert [(r.prompt_ids, r.output_len) for r in with_adapters] == [(r.prompt_ids, r.output_len) for r in base]
        names = {r.adapter for r in with_adapters}
        assert names <= {f"lora-{i:04d}" for i in range(n)}, seed
        assert with_adapters == build_requests(config, n)
    for r in base:
        assert 8 <= len(r.prompt_ids) < 512 and 8 <= r.output_len < 512
        assert min(r.prompt_ids) >= 4 and max(r.prompt_ids) < 1000
    assert build_requests(RequestSetConfig(count=50, seed=seed + 1), 0) != build_requests(
        RequestSetConfig(count=50, seed=seed), 0)


def test_adapters_are_uniform(rng):
    n = int(rng.integers(3, 12))
    requests = build_requests(RequestSetConfig(count=6000, seed=int(rng.integers(0, 2**31))), n)
    counts = np.bincount([int(r.adapter.split("-")[1]) for r in requests], minlength=n)
    expected = 6000 / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 3 * n + 30, (rng.seed_value, counts)  # far above the chi-square's mean (n - 1)


def test_poisson_offsets(rng):
    for _ in range(5):
        rate, duration = float(rng.uniform(2, 80)), float(rng.uniform(20, 120))
        seed = int(rng.integers(0, 2**31))
        offsets = poisson_offsets(rate, duration, seed)
        assert offsets.min() >= 0 and offsets.max() < duration and np.all(np.diff(offsets) > 0)
        expected = rate * duration
        assert abs(len(offsets) - expected) < 5 * math.sqrt(expected) + 1, rng.seed_value
        gaps = np.diff(offsets)
        cv_tolerance = 4 / math.sqrt(gaps.size) + 0.02  # the sample cv of exponential gaps: sd about 1 / sqrt(n)
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=cv_tolerance), rng.seed_value
        # the same unit-rate arrivals stretched in time for another rate
        other = poisson_offsets(rate * 2, duration, seed)
        common = min(len(other), len(offsets))
        assert other[:common] * 2 == pytest.approx(offsets[:common])
        assert np.array_equal(offsets, poisson_offsets(rate, duration, seed))


def test_poisson_schedule_cycles_the_request_set(rng):
    requests = build_requests(RequestSetConfig(count=int(rng.integers(3, 20)), seed=1), 2)
    schedule = poisson_schedule(requests, 50.0, 4.0, int(rng.integers(0, 2**31)))
    assert len(schedule) > len(requests)
    assert [s.index for s in schedule] == list(range(len(schedule)))
    assert all(s.request is requests[s.index % len(requests)] for s in schedule)


# -- sweep points and the knee -----------------------------------------------------------------------------------------


def _queue_run(rng, rate: float, service_rps: float, duration: float, tokens: int = 10) -> tuple[list, float]:
    """A single-server FIFO queue fed by Poisson arrivals: each request's tokens come evenly during its service."""
    arrivals = poisson_offsets(rate, duration, int(rng.integers(0, 2**31)))
    free, records = 0.0, []
    service = 1.0 / service_rps
    for i, a in enumerate(arrivals):
        start = max(a, free)
        free = start + service
        chunks = [(start + service * (k + 1) / tokens, 1) for k in range(tokens)]
        records.append(_record(i, float(a), float(a), chunks, free))
    return records, free


def test_sweep_point_of_a_stable_and_an_overloaded_queue(rng):
    capacity = float(rng.uniform(5, 40))
    duration, warmup = 120.0, 20.0
    stable, end = _queue_run(rng, 0.5 * capacity, capacity, duration)
    point = summarize_sweep_point("t", 1, 0.5, 0.5 * capacity, duration, warmup, stable, end)
    assert point.achieved_rps / point.offered_in_window_rps > 0.95, rng.seed_value
    assert point.meets_throughput and point.steady and point.completed == point.sent == len(stable)
    assert point.achieved_tok_per_s == pytest.approx(10 * point.achieved_rps, rel=0.05)
    overloaded, end = _queue_run(rng, 1.5 * capacity, capacity, duration)
    point = summarize_sweep_point("t", 1, 1.5, 1.5 * capacity, duration, warmup, overloaded, end)
    assert point.achieved_rps == pytest.approx(capacity, rel=0.05), rng.seed_value
    assert not point.meets_throughput and not point.meets_ttft and not point.qualifies


def test_sweep_point_counts_unfinished_requests_as_infinite_ttft():
    records = [_record(i, 1.0 + i * 0.01, 1.0 + i * 0.01, [(1.2 + i * 0.01, 1)], 1.3 + i * 0.01) for i in range(90)]
    records += [_record(100 + i, 2.0, 2.0, [], None, requested=5, error=UNFINISHED) for i in range(10)]
    point = summarize_sweep_point("t", 0, 1.0, 30.0, 3.0, 0.5, records, 9.0)
    assert point.ttft_inf and point.ttft_p99 is None and not point.meets_ttft
    assert point.unfinished == 10 and point.failed == 0 and point.completed == 90


def _point(rate: float, ok_throughput: bool, ttft_p99: float) -> SweepPoint:
    return SweepPoint(target="t", adapters=0, fraction=rate, offered_rps=rate, duration_s=10, warmup_s=2, sent=10,
                      completed=10, unfinished=0, failed=0, offered_in_window_rps=rate, achieved_rps=rate,
                      achieved_tok_per_s=0, overall_rps=rate, ttft_p50=None, ttft_p99=ttft_p99, ttft_inf=False,
                      itl_p50=None, itl_p99=None, latency_p50=0.1, send_lag_p99=0, meets_throughput=ok_throughput,
                      meets_ttft=ttft_p99 <= KNEE_MAX_TTFT_P99_S, steady=True)


def test_knee_is_the_highest_qualifying_offered_rate(rng):
    for _ in range(200):
        rates = sorted(set(np.round(rng.uniform(0.1, 100, int(rng.integers(1, 8))), 3).tolist()))
        points = [_point(r, bool(rng.random() < 0.7), float(rng.uniform(0.01, 2))) for r in rates]
        rng.shuffle(points)
        knee = find_knee(points)
        qualifying = [p.offered_rps for p in points if p.meets_throughput and p.meets_ttft]
        assert knee == (max(qualifying) if qualifying else None), rng.seed_value
        assert knee is None or knee in rates
        notes = knee_notes(points)
        lower_failed = knee is not None and any(p.offered_rps < knee and not p.qualifies for p in points)
        assert any("not monotone" in n for n in notes) == lower_failed


def test_offline_summary(rng):
    n = int(rng.integers(5, 50))
    records = []
    for i in range(n):
        k = int(rng.integers(1, 20))
        records.append(_record(i, 0.0, 0.0, [(0.1 + 0.01 * j, 1) for j in range(k)], 0.1 + 0.01 * k,
                               requested=k + (1 if i == 0 else 0)))
    records.append(_record(n, 0.0, 0.0, [], None, requested=3, error=UNFINISHED))
    result = summarize_offline("t", 3, records, 2.0, capped=True)
    assert result.completed == n and result.failed == 1 and result.exact_length == n - 1
    assert result.req_per_s == pytest.approx(n / 2.0)
    assert result.output_tok_per_s == pytest.approx(sum(r.output_tokens for r in records[:n]) / 2.0)


# -- soak arithmetic, processes ----------------------------------------------------------------------------------------


def test_linear_slope_recovers_a_trend(rng):
    slope, intercept = float(rng.normal(0, 5)), float(rng.uniform(100, 1000))
    times = np.sort(rng.uniform(0, 600, 80))
    values = intercept + slope * times + rng.normal(0, 0.01, times.size)
    assert linear_slope(times.tolist(), values.tolist()) == pytest.approx(slope, abs=1e-3), rng.seed_value
    assert linear_slope([1.0], [2.0]) is None and linear_slope([1.0, 1.0], [2.0, 3.0]) is None


def test_memory_summary(rng):
    growth = float(rng.uniform(0.1, 10))  # MB per second for pid 2
    samples = [{"t": float(t), "rss_mb": {1: 100.0, 2: 50.0 + growth * t}, "gpu_mib": {2: 1000.0},
                "gpu_all_mib": 1500.0} for t in range(0, 60, 5)]
    memory = summarize_memory(samples, {1: "tritonserver", 2: "stub:generator"})
    stub = memory["host_rss"]["stub:generator (2)"]
    assert stub["slope_mb_per_min"] == pytest.approx(growth * 60, abs=1e-3)  # rounded to 3 decimals
    assert stub["start_mb"] == 50.0 and stub["max_mb"] == stub["end_mb"] == pytest.approx(50 + growth * 55, abs=0.1)
    assert memory["host_rss"]["tritonserver (1)"]["slope_mb_per_min"] == pytest.approx(0, abs=1e-9)
    assert memory["gpu"]["stub:generator (2)"]["max_mb"] == 1000.0 and memory["gpu_all_processes"]["end_mb"] == 1500
    no_gpu = [{**s, "gpu_mib": None, "gpu_all_mib": None} for s in samples]
    assert summarize_memory(no_gpu, {})["gpu"] is None


def test_process_tree_and_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        tree = process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        assert rss_bytes(child.pid) > 1_000_000 and process_label(child.pid).startswith("python")
    finally:
        child.kill()
        child.wait()


def test_budget():
    budget = Budget(time.monotonic() + 100, min_run_s=10)
    assert budget.allows(50) and not budget.allows(200) and budget.cap(500) <= 100 and budget.cap(5) == 5
    assert not Budget(time.monotonic() + 5, min_run_s=10).allows(0)


# -- store and report --------------------------------------------------------------------------------------------------


def _offline(target: str, n: int, rps: float) -> dict:
    from dataclasses import asdict

    from perf.capacity.metrics import OfflineResult

    return asdict(OfflineResult(target, n, 10, 10, 10, 0, 10 / rps, rps, 100 * rps, 1000, False,
                                meta={"max_loras": 8} if target.startswith("vllm") else {}))


def test_store_merges_calls_and_rates_against_the_engine(tmp_path, rng):
    config = {"shape": "tiny", "x": int(rng.integers(0, 100))}
    store = Store(tmp_path / "s.json", config)
    engine_rps = float(rng.uniform(1, 50))
    store.put_offline(_offline("engine", 5, engine_rps), 0, ["a", "b", "c"])
    store.save()
    again = Store(tmp_path / "s.json", config)  # a second call
    again.put_offline(_offline("server_stream", 5, engine_rps / 2), 1, ["a", "x", "c"])
    again.put_offline(_offline("vllm_k8", 5, engine_rps / 4), 1)
    again.put_offline(_offline("vllm_k32", 5, engine_rps / 3), 1)
    assert again.capacity("engine", 5) == engine_rps and again.capacity("engine", 0) is None
    rows = {r["target"]: r for r in offline_rows(again, [0, 5])}
    assert rows["server_stream"]["ratio_req_per_s"] == pytest.approx(0.5)
    assert rows["vllm_best"]["ratio_req_per_s"] == pytest.approx(1 / 3) and rows["engine"]["call"] == 0
    assert token_identity(again) == [{"target": "server_stream", "adapters": 5, "engine_call": 0, "compared": 3,
                                      "identical": 2}]
    assert not Store(tmp_path / "s.json", config, fresh=True).data["offline"]


def test_merging_stores_of_calls_on_several_machines(tmp_path, rng):
    config = {"shape": "tiny"}
    first = Store(tmp_path / "a.json", config)  # a machine: call 0, then call 1 (the second store holds both)
    first.data["calls"].append({"date": "2026-12-04T10:00:00", "command": "engine"})
    first.put_offline(_offline("engine", 5, 10.0), 0, ["a", "b"])
    first.add("skipped", "engine sweep: no capacity (call 0)")
    first.save()
    second = Store(tmp_path / "a.json", config)
    second.data["calls"].append({"date": "2026-12-04T10:09:00", "command": "server"})
    second.put_offline(_offline("server_stream", 5, 5.0), 1, ["a", "c"])
    second.path = tmp_path / "b.json"
    second.save()
    other = Store(tmp_path / "c.json", config)  # a fresh machine later: its call 0 is the third call
    other.data["calls"].append({"date": "2026-12-04T11:00:00", "command": "vllm"})
    other.put_offline(_offline("vllm_k8", 5, float(rng.uniform(1, 20))), 0)
    other.add("warnings", "something (call 0)")
    other.save()
    paths = [tmp_path / "c.json", tmp_path / "a.json", tmp_path / "b.json"]
    rng.shuffle(paths)
    merged = merge_stores(paths, tmp_path)
    assert [c["command"] for c in merged.data["calls"]] == ["engine", "server", "vllm"]
    assert {k: e["call"] for k, e in merged.data["offline"].items()} == {"engine|5": 0, "server_stream|5": 1,
                                                                          "vllm_k8|5": 2}
    assert merged.data["warnings"] == ["something (call 2)"]
    assert merged.data["skipped"] == ["engine sweep: no capacity (call 0)"]
    assert token_identity(merged) == [{"target": "server_stream", "adapters": 5, "engine_call": 0, "compared": 2,
                                       "identical": 1}]
    stranger = Store(tmp_path / "d.json", {"shape": "llama3-8b"})
    stranger.save()
    with pytest.raises(ValueError, match="different configurations"):
        merge_stores([tmp_path / "a.json", tmp_path / "d.json"], tmp_path)


def test_a_merged_header_keeps_the_versions_every_call_saw(tmp_path, rng):
    """A server call saw tritonserver, a later vLLM call ran where it is not installed: the merge keeps both."""
    config = {"shape": "tiny"}
    server, peer = f"2.{rng.integers(40, 60)}.0", f"0.{rng.integers(20, 30)}.0"
    calls = (("a.json", "2026-12-07T06:07:35", {"torch": "2.11.0", "tritonserver": server}),
             ("b.json", "2026-12-07T06:16:20", {"torch": "2.11.0", "tritonserver": "not installed", "vllm": peer}))
    for name, date, versions in calls:
        store = Store(tmp_path / name, config)
        store.data["calls"].append({"date": date, "command": name})
        store.data["header"] = {"command": name, "versions": versions}
        store.save()
    merged = merge_stores([tmp_path / "b.json", tmp_path / "a.json"], tmp_path / "m")
    assert merged.data["header"]["command"] == "b.json"  # the latest call's header
    assert merged.data["header"]["versions"] == {"torch": "2.11.0", "tritonserver": server, "vllm": peer}


def test_each_ratio_is_against_the_engine_of_its_own_call(tmp_path, rng):
    """Two calls each ran the engine (at different speeds) and a target: each target is rated against its own
    call's engine, also after the stores of both calls are merged; a call without an engine run at that count
    falls back to the latest, and the table says so."""
    config = {"shape": "tiny"}
    slow, fast = sorted(float(x) for x in rng.uniform(10, 50, size=2))
    first = Store(tmp_path / "a.json", config)
    first.data["calls"].append({"date": "2026-12-06T10:00:00", "command": "engine,server_stream"})
    first.put_offline(_offline("engine", 5, slow), 0, ["a", "b", "c"])
    first.put_offline(_offline("server_stream", 5, 0.9 * slow), 0, ["a", "b", "y"])
    first.save()
    second = Store(tmp_path / "a.json", config)  # the same machine, a later call: its engine replaces the first's
    second.data["calls"].append({"date": "2026-12-06T10:09:00", "command": "engine,vllm"})
    second.put_offline(_offline("engine", 5, fast), 1, ["a", "x", "c"])
    second.put_offline(_offline("vllm_k8", 5, 0.5 * fast), 1)
    second.put_offline(_offline("server_nostream", 5, 0.8 * fast), 2)  # a call that ran no engine
    second.path = tmp_path / "b.json"
    second.save()
    rows = {r["target"]: r for r in offline_rows(second, [5])}
    assert rows["engine"]["req_per_s"] == fast
    assert rows["server_stream"]["ratio_req_per_s"] == pytest.approx(0.9)
    assert rows["server_stream"]["baseline_call"] == 0
    assert rows["vllm_best"]["ratio_req_per_s"] == pytest.approx(0.5)
    assert rows["server_nostream"]["ratio_req_per_s"] == pytest.approx(0.8)
    assert rows["server_nostream"]["baseline_call"] == 1
    table = offline_table(list(rows.values()), [5])
    assert "(x0.90)" in table and "(x0.80 of call 1's engine)" in table

    for name in ("a.json", "b.json"):  # stores written before engine runs were kept per call
        old = json.loads((tmp_path / name).read_text())
        del old["engine_runs"]
        (tmp_path / name).write_text(json.dumps(old))
    merged = merge_stores([tmp_path / "b.json", tmp_path / "a.json"], tmp_path / "m")
    merged_rows = {r["target"]: r for r in offline_rows(merged, [5])}
    assert merged_rows["server_stream"]["ratio_req_per_s"] == pytest.approx(0.9)
    assert merged_rows["vllm_best"]["ratio_req_per_s"] == pytest.approx(0.5)
    # tokens: the server against its own call's engine (2 of 3; 1 of 3 against the later engine), the engine of
    # call 1 against call 0's (2 of 3)
    assert token_identity(merged) == [
        {"target": "server_stream", "adapters": 5, "engine_call": 0, "compared": 3, "identical": 2},
        {"target": "engine", "adapters": 5, "engine_call": 0, "call": 1, "compared": 3, "identical": 2}]


def test_sweeps_group_points_and_report_the_knee(tmp_path):
    from dataclasses import asdict

    store = Store(tmp_path / "s.json", {})
    for rate, ok in ((1.0, True), (2.0, True), (3.0, False)):
        store.put_sweep(asdict(_point(rate, ok, 0.2)), 0)
    result = sweeps(store)["t|0"]
    assert result["knee_rps"] == 2.0 and [p["offered_rps"] for p in result["points"]] == [1.0, 2.0, 3.0]


def test_capacity_request_is_hashable_and_frozen():
    r = CapacityRequest(0, (1, 2), 3, None)
    with pytest.raises(AttributeError):
        r.output_len = 4  # type: ignore[misc]

"""Report math on hand-made records: percentiles, ITL per token, SLO attainment, throughput."""

from __future__ import annotations

import json

import pytest

from perf.workload.records import RequestRecord, read_records, write_records
from perf.workload.report import markdown_table, percentile, read_summary, summarize, write_run


def _record(i, send, chunks, end=None, error=None):
    r = RequestRecord(index=i, adapter="a", prompt_tokens=4, output_tokens_requested=4, arrival_s=send, send_s=send)
    for t, k in chunks:
        r.add_chunk(t, k)
    r.end_s = end if end is not None else (chunks[-1][0] if chunks else None)
    r.error = error
    return r


def test_itl_counts_each_token():
    r = _record(0, 0.0, [(1.0, 1), (1.5, 1), (2.5, 2)])
    assert r.ttft == 1.0 and r.latency == 2.5 and r.output_tokens == 4
    assert r.inter_token_latencies() == [0.5, 0.5, 0.5]


def test_summary_math():
    records = [
        _record(0, 0.0, [(1.0, 1), (2.0, 1)]),  # ttft 1
        _record(1, 1.0, [(4.0, 1), (5.0, 3)]),  # ttft 3
        _record(2, 2.0, [(10.0, 2)]),  # ttft 8: misses a 6 s SLO
        _record(3, 3.0, [], end=3.5, error="refused"),  # failed, no token
        RequestRecord(index=4, adapter=None, prompt_tokens=1, output_tokens_requested=1, arrival_s=9.0),  # unsent
    ]
    s = summarize("x", records, wall_s=10.0, slo_ttft_s=6.0)
    assert (s.requests, s.sent, s.completed, s.failed) == (5, 4, 3, 1)
    assert s.req_per_s == pytest.approx(0.3)
    assert s.output_tok_per_s == pytest.approx((2 + 4 + 2) / 10.0)
    assert s.ttft_p50 == pytest.approx(3.0)
    assert s.ttft_mean == pytest.approx(4.0)
    assert s.ttft_p99 == pytest.approx(percentile([1.0, 3.0, 8.0], 99))
    assert s.slo_attainment == pytest.approx(2 / 4)
    assert s.latency_mean == pytest.approx((2.0 + 4.0 + 8.0) / 3)
    # ITL samples: 1.0 (req 0), 1/3 x3 (req 1)
    assert s.itl_p50 == pytest.approx(1 / 3)
    assert s.first_error == "refused"
    assert "| x | 4 | 3 | 0.30 |" in markdown_table([s])


def test_empty_and_round_trips(tmp_path):
    s = summarize("empty", [], wall_s=0.0)
    assert s.req_per_s == 0 and s.ttft_p50 is None and s.slo_attainment == 0.0
    records = [_record(0, 0.0, [(1.0, 1), (2.0, 2)])]
    assert read_records(write_records(tmp_path / "r.jsonl", records)) == records
    path = write_run(tmp_path, summarize("run a", records, 2.0), records)
    assert read_summary(path).completed == 1
    assert json.loads(path.read_text())["name"] == "run a"
    assert (tmp_path / "run_a.requests.jsonl").is_file()

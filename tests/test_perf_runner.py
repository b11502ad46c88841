"""The in-process replay on a tiny random model: every request served, every summary field filled."""

from __future__ import annotations

from dataclasses import fields

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.scheduling.engine import Engine
from model_factory import make_base, write_random_adapter
from perf.engine.engine_target import EngineTarget
from perf.workload.report import Summary
from perf.workload.runner import run_target
from perf.workload.trace import WorkloadConfig, generate_trace


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf")
    base = make_base(root / "base")
    targets = ["q_proj", "v_proj", "down_proj"]
    adapters = {f"lora-{i:04d}": str(write_random_adapter(root / f"a{i}", base, rank=4, targets=targets, seed=i))
                for i in range(3)}
    eng = Engine(EngineConfig(model_dir=str(base), adapters=adapters, max_model_len=128))
    yield eng
    eng.shutdown()


def test_replay_engine_smoke(engine, tmp_path):
    trace = generate_trace(WorkloadConfig(num_adapters=3, rate=10, duration_s=1.0, input_range=(4, 12),
                                          output_range=(3, 8), base_fraction=0.3, seed=1, vocab_range=(2, 250)))
    assert len(trace) == 10
    summary, result = run_target("smoke", trace, EngineTarget(engine), tmp_path, max_duration_s=60, progress=False)
    assert not result.capped
    assert summary.completed == summary.sent == 10 and summary.failed == 0
    for r, req in zip(result.records, trace, strict=True):
        assert r.output_tokens == req.output_len  # ignore_eos: exact lengths
        assert r.send_s >= req.arrival_s - 1e-3 and r.first_token_s <= r.end_s
    missing = [f.name for f in fields(Summary) if getattr(summary, f.name) is None]
    assert missing == ["first_error"], missing
    assert summary.slo_attainment == 1.0 and summary.req_per_s > 0 and summary.output_tok_per_s > 0
    assert (tmp_path / "smoke.summary.json").is_file() and (tmp_path / "smoke.requests.jsonl").is_file()


def test_refused_request_is_recorded(engine):
    trace = generate_trace(WorkloadConfig(num_adapters=50, rate=20, duration_s=0.2, input_range=(4, 6),
                                          output_range=(2, 3), seed=2, vocab_range=(2, 250)))
    summary, result = run_target("refused", trace, EngineTarget(engine), None, max_duration_s=30, progress=False)
    unknown = [r for r in result.records if int(r.adapter.split("-")[1]) >= 3]
    assert unknown and all(r.error for r in unknown)
    assert summary.failed == len(unknown) and summary.completed == len(trace) - len(unknown)

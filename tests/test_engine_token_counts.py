"""The token counts and finish reason each response carries (num_input_tokens, num_output_tokens, finish_reason), and
the per-adapter running / waiting counts of the engine's stats that routers read."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.response_tensors import output_arrays
from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_adapter, make_base


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("counts")
    base = make_base(root / "base", "llama", seed=5)
    adapters = {name: str(make_adapter(base, root / name, rank=4, targets=["q_proj", "v_proj"], seed=i))
                for i, name in enumerate(("a", "b"))}
    eng = Engine(EngineConfig(model_dir=str(base), adapters=adapters, max_model_len=96, max_num_seqs=2))
    yield eng
    eng.shutdown()


def _run(engine: Engine, request: GenerationRequest) -> list[GenerationOutput]:
    chunks: list[GenerationOutput] = []
    done = threading.Event()

    def emit(out: GenerationOutput) -> None:
        chunks.append(out)
        if out.finished or out.error:
            done.set()

    engine.submit(request, emit)
    assert done.wait(60)
    return chunks


@pytest.mark.parametrize("stream", [True, False])
def test_output_tokens_add_up_to_every_generated_token(engine, stream):
    prompt = [0, 17, 33, 61, 90, 120]
    free = generate(engine, [GenerationRequest("free", prompt, "a", SamplingParams(max_tokens=24, ignore_eos=True))])
    text = free[0].text(engine.tokenizer)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for sampling, reason in ((SamplingParams(max_tokens=24, ignore_eos=True), b"length"),
                             (SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)), b"stop")):
        before = engine.stats()["tokens_out"]
        chunks = _run(engine, GenerationRequest(f"r{stream}{reason}", prompt, "a", sampling, stream=stream))
        generated = engine.stats()["tokens_out"] - before
        assert sum(c.output_tokens for c in chunks) == generated  # a stop string's cut tokens included
        assert {c.prompt_tokens for c in chunks} == {len(prompt)}
        arrays = [dict(output_arrays(c, frozenset({"num_input_tokens", "num_output_tokens", "finish_reason"})))
                  for c in chunks]
        assert all(a["num_input_tokens"].dtype == np.uint32 for a in arrays)
        assert [a["finish_reason"][0, 0] for a in arrays] == [b""] * (len(arrays) - 1) + [reason]
        if reason == b"length":
            assert generated == 24 and sum(len(c.token_ids) for c in chunks) == 24


def test_stats_count_running_and_waiting_requests_per_adapter(engine):
    """Five long requests on a batch of 2: the stats name the adapters in the batch and in the queue, the base's
    requests are not listed, and the counts add up to the totals less the base's."""
    done = threading.Event()
    finished = []

    def emit(out: GenerationOutput) -> None:
        if out.finished or out.error:
            finished.append(out)
            if len(finished) == 5:
                done.set()

    for i, adapter in enumerate(("a", "b", "a", None, "b")):
        engine.submit(GenerationRequest(f"mix{i}", [0, 5, 9], adapter,
                                        SamplingParams(max_tokens=80, ignore_eos=True)), emit)
    seen = []
    while not done.is_set():
        stats = engine.stats()
        seen.append(stats)
        running, waiting = stats["running_adapters"], stats["waiting_adapters"]
        assert sum(running.values()) <= stats["running"] <= 2
        assert set(running) | set(waiting) <= {"a", "b"}
        done.wait(0.005)
    assert any(s["waiting_adapters"] for s in seen) and any(s["running_adapters"] for s in seen)
    assert {n for s in seen for n in s["running_adapters"]} == {"a", "b"}
    assert engine.stats()["running_adapters"] == {} and engine.stats()["waiting_adapters"] == {}
    assert engine.stats()["max_loras"] == engine.config.max_loras

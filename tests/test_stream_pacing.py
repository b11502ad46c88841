"""stream_responses_per_s: with many streams running, each stream's chunks come at most every
(streams running) / rate seconds; with few, stream_interval_ms alone decides; the text is the same either way."""

from __future__ import annotations

import random
import threading
import time

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_base

STREAMS = 16
INTERVAL_S = 0.05  # each stream's interval while all STREAMS run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("pacing") / "base", "llama", seed=11)


def _stream_all(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[tuple[float, GenerationOutput]]]:
    chunks: dict[str, list[tuple[float, GenerationOutput]]] = {r.request_id: [] for r in requests}
    done = threading.Semaphore(0)

    def emitter(rid):
        def emit(out):
            chunks[rid].append((time.perf_counter(), out))
            if out.finished:
                done.release()
        return emit

    for request in requests:
        engine.submit(request, emitter(request.request_id))
    for _ in requests:
        assert done.acquire(timeout=120)
    return chunks


@pytest.mark.parametrize("rate", [0.0, STREAMS / INTERVAL_S])
def test_many_streams_share_a_response_rate(base, rate):
    engine = Engine(EngineConfig(model_dir=str(base), max_model_len=256, max_num_seqs=STREAMS, stream_interval_ms=0.0,
                                 stream_responses_per_s=rate))
    try:
        rng = random.Random()
        requests = [GenerationRequest(f"p{i}", [0] + [rng.randrange(4, 300) for _ in range(6)],
                                      sampling=SamplingParams(max_tokens=150, ignore_eos=True)) for i in range(STREAMS)]
        chunks = _stream_all(engine, requests)
        whole = generate(engine, [GenerationRequest(r.request_id + "-whole", r.prompt_ids, sampling=r.sampling,
                                                    stream=False) for r in requests])
    finally:
        engine.shutdown()
    for request, result in zip(requests, whole, strict=True):
        got = chunks[request.request_id]
        assert [t for _, out in got for t in out.token_ids] == result.token_ids
        assert [out.finished for _, out in got].count(True) == 1 and got[-1][1].finished
        gaps = [b - a for (a, _), (b, _) in zip(got, got[1:-1], strict=False)]  # the last goes with the end
        if rate == 0:  # a chunk a step (several tokens only where a character spans tokens)
            assert len(got) >= len(result.token_ids) // 4, f"{request.request_id}: {len(got)} chunks"
        else:  # every stream runs to the end together (same lengths): no two chunks closer than the interval
            assert gaps, f"{request.request_id}: {len(got)} chunks, none between the first and the last"
            assert min(gaps) >= INTERVAL_S * (STREAMS - 1) / STREAMS - 0.002, gaps

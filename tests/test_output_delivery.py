"""Outputs delivered off the engine process's receiver thread (manylora/engine/scheduling/delivery.py), merged while
they wait (manylora/engine/requests/coalesce.py): a request's merged chunks carry the same tokens, text, token counts
and end as the chunks they replace, in order, whatever the timing; errors and heartbeats keep their meaning."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.coalesce import merge_outputs
from manylora.engine.requests.detokenize import decode_chunk, load_tokenizer
from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.delivery import OutputDelivery
from manylora.engine.scheduling.engine import Engine
from model_factory import make_adapter, make_base


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """Real per-token streams (stream_interval_ms 0) of a few requests, with stop strings, from the engine."""
    root = tmp_path_factory.mktemp("delivery")
    base = make_base(root / "base", "llama", seed=3)
    adapter = make_adapter(base, root / "a", rank=4, targets=["q_proj", "v_proj"], seed=4)
    engine = Engine(EngineConfig(model_dir=str(base), adapters={"a": str(adapter)}, max_model_len=96,
                                 stream_interval_ms=0.0))
    rng = random.Random()
    requests = [GenerationRequest(f"s{i}", [0] + [rng.randrange(4, 300) for _ in range(rng.randint(3, 12))],
                                  rng.choice([None, "a"]),
                                  SamplingParams(max_tokens=rng.randint(8, 40), temperature=rng.choice([0.0, 1.0]),
                                                 seed=rng.randrange(2**30), stop=rng.choice([(), ("e",), (" t",)])))
                for i in range(12)]
    outputs: dict[str, list[GenerationOutput]] = {r.request_id: [] for r in requests}
    done = threading.Semaphore(0)

    def emitter(rid):
        def emit(out):
            outputs[rid].append(out)
            if out.finished:
                done.release()
        return emit

    try:
        for request in requests:
            engine.submit(request, emitter(request.request_id))
        for _ in requests:
            assert done.acquire(timeout=120)
    finally:
        engine.shutdown()
    return load_tokenizer(str(base)), outputs


def _text(tokenizer, chunks: list[GenerationOutput]) -> str:
    return "".join(decode_chunk(tokenizer, c.token_ids, c.context_ids, c.strip_chars) for c in chunks)


def _summary(tokenizer, chunks: list[GenerationOutput]) -> tuple:
    finals = [c for c in chunks if c.finished]
    return ([t for c in chunks for t in c.token_ids], _text(tokenizer, chunks), sum(c.output_tokens for c in chunks),
            len(finals), chunks[-1].finished, chunks[-1].finish_reason, {c.adapter_sha256 for c in chunks})


def test_merging_any_run_of_chunks_says_the_same(streams):
    tokenizer, outputs = streams
    rng = random.Random()
    assert any(len(chunks) > 8 for chunks in outputs.values())
    for chunks in outputs.values():
        for _ in range(5):
            merged: list[GenerationOutput] = []
            for chunk in chunks:
                joined = merge_outputs(merged[-1], chunk) if merged and rng.random() < 0.7 else None
                if joined is None:
                    merged.append(chunk)
                else:
                    merged[-1] = joined
            assert _summary(tokenizer, merged) == _summary(tokenizer, chunks)
        whole = chunks[0]
        for chunk in chunks[1:]:
            whole = merge_outputs(whole, chunk)
            assert whole is not None
        assert _summary(tokenizer, [whole]) == _summary(tokenizer, chunks)


def test_heartbeats_and_errors_keep_their_meaning():
    def out(**kw) -> GenerationOutput:
        return GenerationOutput(request_id="r", token_ids=kw.pop("token_ids", []), context_ids=[], **kw)

    beat, chunk = out(heartbeat=True), out(token_ids=[5, 6], output_tokens=2)
    error = out(finished=True, finish_reason="error", error=RequestError(ErrorCode.INTERNAL, "request r: failed"))
    assert merge_outputs(beat, chunk) is chunk and merge_outputs(chunk, beat) is chunk
    assert merge_outputs(beat, beat) is not None and merge_outputs(beat, beat).heartbeat
    assert merge_outputs(chunk, error) is None  # an error goes on its own, after the tokens before it
    last = out(token_ids=[7], output_tokens=3, finished=True, finish_reason="stop", strip_chars=1)
    assert merge_outputs(last, chunk) is None  # nothing merges past the end
    assert merge_outputs(chunk, last).strip_chars == 1 and merge_outputs(chunk, last).output_tokens == 5
    with pytest.raises(ValueError, match="requests r and q"):
        merge_outputs(chunk, replace(chunk, request_id="q"))


def test_delivery_keeps_each_requests_order_and_content_under_a_slow_consumer(streams):
    tokenizer, outputs = streams
    rng = random.Random()
    got: dict[str, list[GenerationOutput]] = {rid: [] for rid in outputs}
    in_call: set[str] = set()
    overlap: list[str] = []
    lock = threading.Lock()

    def deliver(rid: str, output: GenerationOutput) -> None:
        with lock:
            if rid in in_call:
                overlap.append(rid)
            in_call.add(rid)
        time.sleep(rng.uniform(0, 0.004))  # a send that waits for the server
        got[rid].append(output)
        with lock:
            in_call.discard(rid)

    delivery = OutputDelivery(deliver, threads=4)
    queues = {rid: list(chunks) for rid, chunks in outputs.items()}
    while any(queues.values()):  # the engine's order: requests' chunks interleaved
        rid = rng.choice([r for r, q in queues.items() if q])
        delivery.put(rid, queues[rid].pop(0))
        if rng.random() < 0.1:
            time.sleep(0.002)
    delivery.close(timeout=30)
    assert not overlap, f"two threads delivered one request at once: {overlap[:3]}"
    for rid, chunks in outputs.items():
        assert _summary(tokenizer, got[rid]) == _summary(tokenizer, chunks), rid
    delivered = sum(len(chunks) for chunks in got.values())
    assert delivered + delivery.merged == sum(len(chunks) for chunks in outputs.values())
    assert delivery.merged > 0, "a consumer slower than the producer got every chunk on its own"


def test_a_failing_callback_does_not_stop_delivery():
    seen = []

    def deliver(rid, output):
        if rid == "bad":
            raise RuntimeError("client gone")
        seen.append(rid)

    delivery = OutputDelivery(deliver, threads=1)
    for rid in ["bad", "good", "bad", "good2"]:
        delivery.put(rid, GenerationOutput(request_id=rid, token_ids=[1], context_ids=[], output_tokens=1))
    delivery.close()
    assert seen == ["good", "good2"]

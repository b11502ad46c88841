"""Coalesced streams through the real server (stream_interval_ms 150): a response carries several tokens, the
responses concatenate to exactly the non-streamed output, FINAL arrives once, and mixed adapters stay PEFT-exact."""

from __future__ import annotations

import json
import queue
import random

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from test_e2e_oracle import MAX_NEW_TOKENS, PROMPTS, check_mixed_batches, peft_reference

pytestmark = pytest.mark.e2e

INTERVAL_MS = 150


@pytest.fixture(scope="module")
def coalescing_server(model_dir, tmp_path_factory, make_server):
    srv = make_server(model_dir, tmp_path_factory.mktemp("coalescing"), {"stream_interval_ms": str(INTERVAL_MS)})
    try:
        yield srv
    finally:
        srv.stop()


def _tensor(name: str, array: np.ndarray, dtype: str):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _responses(server, model: str, inputs: list, output: str) -> list[tuple[object, bool]]:
    """Every response of one streamed request: (its output's values, whether it is marked final)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(output)],
                                  enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            values = result.as_numpy(output)
            got.append((values, final))
            if final:
                return got
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_generator_streams_several_tokens_a_response_and_final_once(coalescing_server, tokenizer, adapter):
    client = coalescing_server.client()
    several = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=True).ids
        inputs = [_tensor("input_ids", np.array([ids], np.int32), "INT32"),
                  _tensor("max_tokens", np.array([[40]], np.int32), "INT32"),
                  _tensor("stream", np.array([[True]]), "BOOL")]  # the same request as `whole`'s, streamed
        if adapter:
            inputs.append(_tensor("lora_name", np.array([[adapter.encode()]], np.object_), "BYTES"))
        responses = _responses(coalescing_server, "generator", inputs, "output_ids")
        assert [final for _, final in responses].count(True) == 1 and responses[-1][1]
        chunks = [values.reshape(-1).tolist() for values, _ in responses if values is not None]
        streamed = [t for chunk in chunks for t in chunk]
        whole = client.generate_ids(ids, adapter=adapter, max_tokens=40, stream=False)
        assert len(whole) <= 40 and streamed == whole, prompt
        several += max(len(c) for c in chunks) > 1
    assert several, "no response carried more than one token: not coalesced"


def test_llm_stream_and_generate_stream_concatenate_to_the_whole_text(coalescing_server):
    client = coalescing_server.client()
    for prompt in PROMPTS:
        whole = client.generate(prompt, max_tokens=40)
        inputs = [_tensor("text_input", np.array([[prompt.encode()]], np.object_), "BYTES"),
                  _tensor("max_tokens", np.array([[40]], np.int32), "INT32"),
                  _tensor("stream", np.array([[True]]), "BOOL")]
        responses = _responses(coalescing_server, "llm", inputs, "text_output")
        assert [final for _, final in responses].count(True) == 1
        pieces = [v.reshape(-1)[0].decode() for v, _ in responses if v is not None and v.size]
        assert "".join(pieces) == whole, (prompt, pieces, whole)
        status, text = coalescing_server.post("/v2/models/llm/generate_stream",
                                              {"text_input": prompt, "max_tokens": 40, "stream": True})
        assert status == 200, text
        events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
        assert "".join(e["text_output"] for e in events) == whole
        assert len(events) < 40  # coalesced: fewer events than tokens


def test_mixed_adapters_stay_peft_exact(coalescing_server, tokenizer):
    reference = peft_reference(coalescing_server, tokenizer)
    check_mixed_batches(coalescing_server.client(), tokenizer, reference, coalescing_server.catalogue)
    assert MAX_NEW_TOKENS > 1


def test_the_replay_target_counts_every_token_of_coalesced_llm_chunks(coalescing_server, tokenizer):
    """perf's replay target on the `llm` ensemble: a chunk holds several tokens, and each record's tokens are the
    ones the generator makes for the same prompt ids (the text alone could not tell: a chunk is no word)."""
    from perf.server.triton_target import TritonTarget
    from perf.workload.replay import replay
    from perf.workload.trace import TraceRequest

    rng = random.Random()
    trace = [TraceRequest(i, 0.05 * i, rng.choice([None, "pirate"]), rng.randrange(1, 9), rng.randrange(20, 41))
             for i in range(6)]
    target = TritonTarget(coalescing_server.grpc_url, "llm")
    try:
        result = replay(trace, target, max_duration_s=120, progress=False)
    finally:
        target.close()
    client = coalescing_server.client()
    several = 0
    for request, record in zip(trace, result.records, strict=True):
        assert record.error is None and record.end_s is not None, record
        ids = tokenizer.encode(request.prompt_text(), add_special_tokens=True).ids
        made = client.generate_ids(ids, adapter=request.adapter, max_tokens=request.output_len, stream=False)
        assert record.output_tokens == len(made) > 0, (request, record.chunk_tokens, len(made))
        text = client.generate(request.prompt_text(), adapter=request.adapter, max_tokens=request.output_len)
        assert record.output_chars == len(text)
        several += max(record.chunk_tokens) > 1
    assert several, "no chunk carried more than one token: not coalesced"

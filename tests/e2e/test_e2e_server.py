"""The llm ensemble and the generator through the real server: streaming, non-streaming, errors."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from manylora.client import ManyLoraError

pytestmark = pytest.mark.e2e

# corpus sentences whose continuations hold multi-byte characters (crème brûlée, café, Москва)
MULTIBYTE_PROMPTS = (
    "Marcel serves coffee, tea and a very good",
    "They buy bread from Rosa and drink coffee at Marcel's",
    "Anna has a friend in Tokyo, a city that is written",
    "In the evening Marcel closes the",
)


def _generate_stream(server, body: dict) -> list[dict]:
    status, text = server.post("/v2/models/llm/generate_stream", body)
    assert status == 200, text
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("adapter", [None, "shout"])
def test_grpc_stream_generate_stream_and_generate_agree(server, client, adapter):
    """Concatenated streamed text (gRPC, /generate_stream) == /generate text, greedy."""
    non_ascii, chunked = 0, 0
    for prompt in MULTIBYTE_PROMPTS:
        pieces = list(client.stream(prompt, adapter=adapter, max_tokens=24))
        whole = client.generate(prompt, adapter=adapter, max_tokens=24)
        body = {"text_input": prompt, "max_tokens": 24, "stream": True, **({"lora_name": adapter} if adapter else {})}
        events = _generate_stream(server, body)
        assert not any("error" in e for e in events), events
        assert whole, prompt
        assert "".join(pieces) == whole, (prompt, pieces, whole)
        assert "".join(e["text_output"] for e in events) == whole, (prompt, events)
        # no character split between chunks: a split one decodes as U+FFFD in the chunk that ends inside it and is lost
        # from the next (whose context decodes the same way), so the joined text would differ from the whole. A U+FFFD
        # in a chunk is no split when the whole text has it too: a briefly trained base may emit bytes that are no
        # UTF-8 at all (seen: a lone lead byte, then " th"); the equality above then holds with it in both.
        non_ascii += any(ord(ch) > 127 for ch in whole)
        chunked += len(pieces) > 1
    assert chunked, "every request came back in a single chunk: not streamed"
    if adapter is None:
        assert non_ascii, "no continuation with a multi-byte character"


def test_generate_reports_lora_version(server, client):
    import hashlib

    path = server.catalogue["shout"]
    with open(f"{path}/adapter_model.safetensors", "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    assert client.generate_result("In the morning", adapter="shout", max_tokens=4).lora_version == sha
    assert client.generate_result("In the morning", max_tokens=4).lora_version == ""


def test_generate_accepts_scalars_and_lists(server):
    scalar = server.post("/v2/models/llm/generate", {"text_input": "In the morning", "max_tokens": 8})
    listed = server.post("/v2/models/llm/generate", {"text_input": ["In the morning"], "max_tokens": [8]})
    assert scalar[0] == listed[0] == 200, (scalar, listed)
    assert json.loads(scalar[1])["text_output"] == json.loads(listed[1])["text_output"]


def test_stop_string_ends_the_output(client):
    whole = client.generate("In the morning the baker", max_tokens=40)
    words = whole.split()
    assert len(words) > 3, whole
    stop = words[2]
    cut = client.generate("In the morning the baker", max_tokens=40, stop=[stop])
    assert cut == whole[: whole.find(stop)]
    assert "".join(client.stream("In the morning the baker", max_tokens=40, stop=[stop])) == cut


BAD_REQUESTS = {
    "unknown adapter": ({"adapter": "no-such-adapter"}, ["no-such-adapter"]),
    "max_tokens 0": ({"max_tokens": 0}, ["max_tokens"]),
    "max_tokens -3": ({"max_tokens": -3}, ["max_tokens"]),
    "temperature < 0": ({"temperature": -0.5}, ["temperature"]),
    "top_p > 1": ({"top_p": 1.5}, ["top_p"]),
}


def test_bad_requests_fail_alone_while_good_ones_finish(server, client):
    prompts = ["In the morning the baker", "The river runs by", "Marcel closes the caf", "Every morning he said"]
    adapters = sorted(server.catalogue)
    good = [(p, a) for p in prompts for a in adapters]
    # the same optional inputs everywhere, so that good and bad requests can share one execute()
    common = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0}
    expected = {job: "".join(client.stream(job[0], adapter=job[1], **common)) for job in good}
    long_prompt = "the baker opens the shop " * 200

    def run_good(job):
        return "".join(client.stream(job[0], adapter=job[1], **common))

    def run_bad(kwargs):
        try:
            list(client.stream("In the morning the baker", **{"adapter": "shout", **common, **kwargs}))
        except ManyLoraError as e:
            return e.message
        return None

    def run_text(prompt):
        try:
            list(client.stream(prompt, adapter="shout", **common))
        except ManyLoraError as e:
            return e.message
        return None

    with ThreadPoolExecutor(max_workers=24) as pool:
        good_futures = {job: pool.submit(run_good, job) for job in good}
        bad_futures = {name: pool.submit(run_bad, kwargs) for name, (kwargs, _) in BAD_REQUESTS.items()}
        empty = pool.submit(run_text, "")
        too_long = pool.submit(run_text, long_prompt)
        results = {job: f.result() for job, f in good_futures.items()}
        errors = {name: f.result() for name, f in bad_futures.items()}
    for name, (_, words) in BAD_REQUESTS.items():
        assert errors[name] is not None, f"{name}: no error"
        for word in words:
            assert word in errors[name], f"{name}: {errors[name]!r} does not name {word!r}"
    assert empty.result() is not None and "empty" in empty.result()
    message = too_long.result()
    assert message is not None and "context" in message and str(server.max_model_len) in message, message
    assert results == expected
    assert server.ready()


def test_http_generate_errors_are_400_with_the_message(server):
    status, text = server.post("/v2/models/llm/generate", {"text_input": "Hi", "max_tokens": 4, "lora_name": "nope"})
    assert status == 400 and "nope" in json.loads(text)["error"], (status, text)
    status, text = server.post("/v2/models/llm/generate", {"text_input": "", "max_tokens": 4})
    assert status == 400 and "empty" in json.loads(text)["error"], (status, text)
    assert server.ready()


def _raw_stream(server, model: str, inputs: list) -> tuple[list, list]:
    import queue

    results: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    grpc.async_stream_infer(model, inputs, enable_empty_final_response=True)
    responses, errors = [], []
    while True:
        result, error = results.get(timeout=60)
        if error is not None:
            errors.append(error)
            break
        responses.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    grpc.stop_stream()
    grpc.close()
    return responses, errors


def _input(name: str, array: np.ndarray, dtype: str):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_invalid_utf8_prompt_is_refused(server):
    inputs = [
        _input("text_input", np.array([[b"caf\xc3"]], dtype=np.object_), "BYTES"),
        _input("max_tokens", np.array([[4]], dtype=np.int32), "INT32"),
    ]
    _, errors = _raw_stream(server, "llm", inputs)
    assert errors and "UTF-8" in errors[0].message(), errors
    assert server.ready()


def test_generator_with_token_ids_and_control(server, client, tokenizer):
    ids = tokenizer.encode("In the morning the baker", add_special_tokens=True).ids
    out = client.generate_ids(ids, max_tokens=10)
    streamed = client.generate_ids(ids, max_tokens=10, stream=True)
    assert out == streamed and 0 < len(out) <= 10
    assert tokenizer.decode(out) == client.generate("In the morning the baker", max_tokens=10)
    names = {a["name"] for a in client.list_adapters()}
    assert names == set(server.catalogue)
    stats = client.stats()
    assert isinstance(stats, dict) and stats
    inputs = [_input("control", np.array([[b'{"op": "nope"}']], dtype=np.object_), "BYTES")]
    _, errors = _raw_stream(server, "generator", inputs)
    assert errors and "nope" in errors[0].message()

"""Hostile input through the real server: each bad request gets a clear error, good requests sent
alongside finish with the right output, and the server stays ready."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_streams import stream_error

from manylora.client import ManyLoraError

pytestmark = pytest.mark.e2e

PROMPT = "In the morning the baker"


def _input(name: str, array: np.ndarray, dtype: str):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _ids(tokens: list[int]) -> np.ndarray:
    return np.array([tokens], dtype=np.int32)


def _hostile(server, tokenizer) -> dict:
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    one = lambda name, value, dtype, np_dtype: _input(name, np.array([[value]], dtype=np_dtype), dtype)  # noqa: E731
    max4 = one("max_tokens", 4, "INT32", np.int32)
    return {
        "oversized prompt (1 MB of text)": (
            lambda: server.post("/v2/models/llm/generate", {"text_input": "the baker opens the shop " * 40_000,
                                                               "max_tokens": 4}),
            ["context"]),
        "invalid UTF-8 text_input": (
            lambda: stream_error(server, "llm", [_input("text_input", np.array([[b"\xff\xfe caf\xc3"]], np.object_),
                                                     "BYTES"), max4]), ["UTF-8"]),
        "huge max_tokens": (
            lambda: server.post("/v2/models/llm/generate", {"text_input": PROMPT, "max_tokens": 2**31 - 1}),
            ["max_tokens"]),
        "NaN temperature": (
            lambda: stream_error(server, "generator", [_input("input_ids", _ids(ids), "INT32"), max4,
                                                    one("temperature", np.nan, "FP32", np.float32)]),
            ["temperature"]),
        "invalid UTF-8 lora_name": (
            lambda: stream_error(server, "generator", [_input("input_ids", _ids(ids), "INT32"), max4,
                                                    one("lora_name", b"sh\xc3", "BYTES", np.object_)]),
            ["lora_name", "UTF-8"]),
        "oversized stop list": (
            lambda: stream_error(server, "generator", [_input("input_ids", _ids(ids), "INT32"), max4,
                                                    _input("stop", np.array([[b"x"] * 500], np.object_), "BYTES")]),
            ["stop"]),
        "token id outside the vocabulary": (
            lambda: stream_error(server, "generator", [_input("input_ids", _ids([0, 2**31 - 1]), "INT32"), max4]),
            ["vocabulary"]),
        "bad control JSON": (
            lambda: stream_error(server, "generator", [one("control", b"{not json", "BYTES", np.object_)]),
            ["control"]),
    }


def test_hostile_inputs_fail_alone_and_the_server_stays_ready(server, client, tokenizer):
    jobs = [(p, a) for p in (PROMPT, "The river runs by") for a in (None, *sorted(server.catalogue))]
    expected = {job: client.generate(job[0], adapter=job[1], max_tokens=10) for job in jobs}
    hostile = _hostile(server, tokenizer)
    with ThreadPoolExecutor(max_workers=len(jobs) + len(hostile)) as pool:
        good = {job: pool.submit(client.generate, job[0], adapter=job[1], max_tokens=10) for job in jobs}
        bad = {name: pool.submit(call) for name, (call, _) in hostile.items()}
        results = {job: f.result() for job, f in good.items()}
        errors = {name: f.result() for name, f in bad.items()}
    for name, (_, words) in hostile.items():
        message = errors[name]
        if isinstance(message, tuple):  # HTTP: (status, body)
            status, body = message
            assert status == 400, (name, status, body)
            message = json.loads(body)["error"]
        assert message, f"{name}: no error"
        for word in words:
            assert word in message, f"{name}: {message!r} does not name {word!r}"
        assert len(message) < 2000, f"{name}: message too long ({len(message)} chars)"
    assert results == expected
    assert server.ready()
    assert client.generate(PROMPT, max_tokens=10) == expected[(PROMPT, None)]


def test_queue_flood_refuses_some_and_finishes_the_rest(admin_server, tokenizer):
    """max_num_seqs 2 + max_queue_size 4: of 40 concurrent requests, some get "queue full",
    every other one (at least the queue's worth) finishes with the full greedy output."""
    client = admin_server.client()
    ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    expected = client.generate_ids(ids, max_tokens=24)

    def one(_):
        try:
            return client.generate_ids(ids, max_tokens=24)
        except ManyLoraError as e:
            return e

    with ThreadPoolExecutor(max_workers=40) as pool:
        outcomes = list(pool.map(one, range(40)))
    refused = [o for o in outcomes if isinstance(o, ManyLoraError)]
    finished = [o for o in outcomes if not isinstance(o, ManyLoraError)]
    assert refused, "no request was refused: the queue limit did not act"
    assert all("queue full" in e.message and "max_queue_size" in e.message for e in refused), refused[:3]
    # at least the queue's 4 finish; 2 more (the running batch) only if the engine admitted some before the rest
    # arrived: when all 40 reach it first, 4 wait and 36 are refused
    assert len(finished) >= 4, len(finished)
    assert all(o == expected for o in finished)
    print(f"queue flood: {len(finished)} finished, {len(refused)} refused: {refused[0].message!r}")
    assert admin_server.ready()
    assert client.generate_ids(ids, max_tokens=24) == expected
    stats = client.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats

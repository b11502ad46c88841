"""Abandoned requests stop using the engine within 1 s, on every path a client can leave by, through the real server.

Idle, the engine is empty 0.2-0.3 s after the client left (one cancellation poll; each test prints it). The tests
allow STOP_WITHIN_S, a loaded test machine's margin (several test workers on two cores once took over 1 s), still
far below the LONG tokens a request that ran on would take.

Covered: gRPC stream cancelled (the `generator` model and the `llm` ensemble), HTTP generate_stream closed (both),
an HTTP client that times out on a stream, a client process killed mid-stream. Not covered, because Triton 2.51 does
not notice (it reads nothing from the connection of a paused HTTP request): a closed non-streaming HTTP /generate,
which runs to its max_tokens; the last test shows that bound.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("cancellation")]  # one worker: test_zz runs last on its server

LONG = 3000  # tokens a request would run to (ignore_eos): seconds of work on this CPU
STOP_WITHIN_S = 3.0
PROMPT = "In the morning the baker"


@pytest.fixture(scope="module")
def long_server(model_dir, tmp_path_factory, make_server):
    srv = make_server(model_dir, tmp_path_factory.mktemp("cancel"), {"max_model_len": "4096"})
    try:
        yield srv
    finally:
        srv.stop()


def _in_flight(server) -> int:
    stats = server.client().stats()
    return stats["running"] + stats["waiting"]


def _wait_running(server, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while _in_flight(server) < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.02)


def _seconds_to_empty(server, within: float = STOP_WITHIN_S) -> float:
    start = time.monotonic()
    while _in_flight(server):
        assert time.monotonic() - start < within, f"requests still in the engine {within} s after the client left"
        time.sleep(0.02)
    return time.monotonic() - start


def _inputs(model: str) -> tuple[list, dict | None]:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    common = [tensor("max_tokens", np.array([[LONG]], np.int32), "INT32"),
              tensor("stream", np.array([[True]]), "BOOL")]
    if model == "llm":
        return ([tensor("text_input", np.array([[PROMPT.encode()]], np.object_), "BYTES"), *common],
                {"sampling_parameters": json.dumps({"ignore_eos": True})})
    return ([tensor("input_ids", np.array([[0, 40, 41, 42]], np.int32), "INT32"),
             tensor("ignore_eos", np.array([[True]]), "BOOL"), *common], None)


@pytest.mark.parametrize("model", ["llm", "generator"])
def test_grpc_cancel(long_server, model):
    client = grpcclient.InferenceServerClient(long_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs, parameters = _inputs(model)
    for _ in range(4):
        client.async_stream_infer(model, inputs, parameters=parameters)
    _wait_running(long_server, 4)
    responses.get(timeout=10)  # generating
    client.stop_stream(cancel_requests=True)
    print(f"gRPC cancel on {model}: engine empty after {_seconds_to_empty(long_server):.2f} s")
    client.close()


@pytest.mark.parametrize("model", ["llm", "generator"])
def test_http_stream_closed(long_server, model):
    body = ({"text_input": PROMPT, "sampling_parameters": json.dumps({"ignore_eos": True})} if model == "llm"
            else {"input_ids": [0, 40, 41], "ignore_eos": True})
    body.update({"max_tokens": LONG, "stream": True})
    url = f"http://{long_server.http_url}/v2/models/{model}/generate_stream"
    curl = subprocess.Popen(["curl", "-s", "-N", "-H", "Content-Type: application/json", "-d", json.dumps(body), url],
                            stdout=subprocess.PIPE)
    try:
        assert curl.stdout.readline().startswith(b"data:")
        _wait_running(long_server)
    finally:
        curl.kill()
        curl.wait()
    print(f"HTTP stream closed on {model}: engine empty after {_seconds_to_empty(long_server):.2f} s")


def test_http_client_timeout_on_a_stream(long_server):
    body = json.dumps({"text_input": PROMPT, "max_tokens": LONG, "stream": True,
                       "sampling_parameters": json.dumps({"ignore_eos": True})}).encode()
    request = urllib.request.Request(f"http://{long_server.http_url}/v2/models/llm/generate_stream", body,
                                     {"Content-Type": "application/json"})
    deadline = time.monotonic() + 1.0
    with urllib.request.urlopen(request, timeout=10) as reply:
        while time.monotonic() < deadline:  # the client's deadline passes mid-stream: it gives up and closes
            assert reply.read1(256)
    print(f"HTTP client timeout: engine empty after {_seconds_to_empty(long_server):.2f} s")


@pytest.mark.parametrize("model", ["llm", "generator"])
def test_client_killed(long_server, model):
    code = f"""
import json, time, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient({long_server.grpc_url!r}); c.start_stream(callback=lambda result, error: None)
def t(n, a, d):
    x = g.InferInput(n, list(a.shape), d); x.set_data_from_numpy(a); return x
if {model!r} == "llm":
    ins = [t("text_input", np.array([[b"{PROMPT}"]], np.object_), "BYTES")]
    params = {{"sampling_parameters": json.dumps({{"ignore_eos": True}})}}
else:
    ins = [t("input_ids", np.array([[0, 40, 41]], np.int32), "INT32"), t("ignore_eos", np.array([[True]]), "BOOL")]
    params = None
ins += [t("max_tokens", np.array([[{LONG}]], np.int32), "INT32"), t("stream", np.array([[True]]), "BOOL")]
c.async_stream_infer({model!r}, ins, parameters=params)
print("sent", flush=True)
time.sleep(120)
"""
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "sent"
        _wait_running(long_server)
    finally:
        child.kill()
        child.wait()
    print(f"client killed ({model}): engine empty after {_seconds_to_empty(long_server):.2f} s")


def test_an_abandoned_non_streaming_http_request_runs_to_its_max_tokens(long_server):
    """Not covered (module docstring): the request keeps its slot until max_tokens, which bounds the damage."""
    tokens = 600
    body = json.dumps({"text_input": PROMPT, "max_tokens": tokens,
                       "sampling_parameters": json.dumps({"ignore_eos": True})})
    curl = subprocess.Popen(["curl", "-s", "-H", "Content-Type: application/json", "-d", body,
                             f"http://{long_server.http_url}/v2/models/llm/generate"], stdout=subprocess.DEVNULL)
    _wait_running(long_server)
    curl.kill()
    curl.wait()
    left = time.monotonic()
    while _in_flight(long_server):
        assert time.monotonic() - left < 120
        time.sleep(0.05)
    ran = long_server.client().stats()
    print(f"closed non-streaming HTTP request ran on for {time.monotonic() - left:.2f} s to its {tokens} tokens "
          f"(finished so far: {ran['finished']})")


def test_zz_no_cancelled_request_is_left_in_flight(long_server):
    """Run last: Triton waits for requests it thinks are in flight before it exits (its exit timeout), so an ensemble
    request that a cancellation left behind (an error from a step while another step is in flight, in 2.51) shows
    as a slow stop and a line in the log."""
    started = time.monotonic()
    long_server.stop()
    stopped = time.monotonic() - started
    left = [line for line in long_server.log.read_text(errors="replace").splitlines()
            if "has 1 in-flight inferences" in line or "have in-flight inferences" in line and "Found 0" not in line]
    assert not left, left[:3]
    print(f"stopped in {stopped:.1f} s (exit code {long_server.process.returncode})")
    log = long_server.log.read_text(errors="replace")
    if "Exit timeout expired" in log and "Found 0 model versions that have in-flight inferences" in log \
            and "successfully unloaded 'generator'" not in log:
        # no request was left in flight (the line above): Triton kept the generator live and never asked its
        # stub to finalize, seen after test_grpc_cancel in a third to a half of runs (docs/operations.md,
        # "Stopping"); not what this checks
        pytest.xfail(f"the generator stub's unload stalled ({stopped:.1f} s) with no request in flight")
    assert stopped < 20, f"the server took {stopped:.1f} s to stop"

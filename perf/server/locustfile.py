"""Locust load on the `llm` ensemble: streaming requests, power-law adapter choice, TTFT as its own event.

    MANYLORA_GRPC_URL=127.0.0.1:8001 locust -f perf/server/locustfile.py --headless -u 16 -r 4 -t 60s \
        --host http://127.0.0.1:8000 --csv perf/results/locust

    MANYLORA_TRANSPORT=openai locust -f perf/server/locustfile.py --headless -u 16 -r 4 -t 60s \
        --host http://127.0.0.1:9000

Events: "ttft" (time to the first streamed piece) and "generate" (the whole request;
response_length = output characters), both of request_type "grpc-stream", "http-sse" or "openai-sse".
Transport: gRPC streaming through tritonclient (grpc's gevent support switched on at import,
as locust's gRPC example does) when MANYLORA_GRPC_URL is set; otherwise HTTP
POST <host>/v2/models/llm/generate_stream (SSE), or force it with MANYLORA_TRANSPORT=http.
MANYLORA_TRANSPORT=openai drives the OpenAI-compatible front at <host> instead (python -m manylora.openai):
streamed POST <host>/v1/completions (MANYLORA_OPENAI_ENDPOINT=chat: /v1/chat/completions, the prompt as one user
message) with the adapter's name as ``model``; the adapters and the base model's name come from <host>/v1/models.

Environment:
    MANYLORA_ADAPTERS   comma-separated adapter names (default: the server's list, via manylora/client/ over gRPC;
                        none found: base model only)
    MANYLORA_ALPHA      power-law exponent (S-LoRA's np.random.power; 1 = uniform, < 1 favours the first names)
    MANYLORA_INPUT_RANGE / MANYLORA_OUTPUT_RANGE   "lo,hi": prompt words ("Hello " * n) and max_tokens, [lo, hi)
    MANYLORA_BASE_FRACTION   share of requests without an adapter
    MANYLORA_OPENAI_ENDPOINT   completions (default) or chat, with MANYLORA_TRANSPORT=openai
"""

from __future__ import annotations

import json
import os
import queue
import random
import time

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC channel exists

import numpy as np  # noqa: E402
from locust import User, between, events, task  # noqa: E402

GRPC_URL = os.environ.get("MANYLORA_GRPC_URL", "")
TRANSPORT = os.environ.get("MANYLORA_TRANSPORT", "grpc" if GRPC_URL else "http")
ALPHA = float(os.environ.get("MANYLORA_ALPHA", "1.0"))
BASE_FRACTION = float(os.environ.get("MANYLORA_BASE_FRACTION", "0"))
TIMEOUT_S = float(os.environ.get("MANYLORA_TIMEOUT", "120"))
OPENAI_ENDPOINT = os.environ.get("MANYLORA_OPENAI_ENDPOINT", "completions")
if TRANSPORT not in ("grpc", "http", "openai"):
    raise ValueError(f"MANYLORA_TRANSPORT must be grpc, http or openai, got {TRANSPORT!r}")
if OPENAI_ENDPOINT not in ("completions", "chat"):
    raise ValueError(f"MANYLORA_OPENAI_ENDPOINT must be completions or chat, got {OPENAI_ENDPOINT!r}")


def _range(name: str, default: tuple[int, int]) -> tuple[int, int]:
    raw = os.environ.get(name)
    if not raw:
        return default
    lo, hi = (int(x) for x in raw.split(","))
    return lo, hi


INPUT_RANGE = _range("MANYLORA_INPUT_RANGE", (8, 64))
OUTPUT_RANGE = _range("MANYLORA_OUTPUT_RANGE", (8, 64))
ADAPTERS: list[str] = []
BASE_MODEL: list[str] = []  # the OpenAI front's name of the base model (from /v1/models)


@events.init.add_listener
def _load_adapters(environment, **_kwargs) -> None:
    """Adapter names from the environment, else from the server (manylora/client/ library, gRPC control request)."""
    ADAPTERS.clear()
    BASE_MODEL.clear()
    given = os.environ.get("MANYLORA_ADAPTERS", "")
    if TRANSPORT == "openai":
        _load_openai_models(environment.host or "", not given)
    if given:
        ADAPTERS.extend(a for a in given.split(",") if a)
    elif GRPC_URL and TRANSPORT != "openai":
        try:
            from manylora.client import ManyLoraClient

            ADAPTERS.extend(a["name"] for a in ManyLoraClient(grpc_url=GRPC_URL).list_adapters())
        except Exception as e:  # noqa: BLE001 - run on the base model rather than not at all
            print(f"locustfile: cannot list adapters ({e}); base model only")


def _load_openai_models(host: str, with_adapters: bool) -> None:
    """The base model's name and (``with_adapters``) the adapters, from the front's GET /v1/models."""
    import requests

    reply = requests.get(f"{host.rstrip('/')}/v1/models", timeout=30)
    reply.raise_for_status()
    models = reply.json()["data"]
    BASE_MODEL.extend(m["id"] for m in models if m.get("parent") is None)
    if with_adapters:
        ADAPTERS.extend(m["id"] for m in models if m.get("parent") is not None)


def choose_adapter(rng: np.random.Generator) -> str | None:
    """S-LoRA's choice: int(power(alpha) * n); None (base model) with BASE_FRACTION or no adapters."""
    if not ADAPTERS or rng.random() < BASE_FRACTION:
        return None
    return ADAPTERS[min(int(rng.power(ALPHA) * len(ADAPTERS)), len(ADAPTERS) - 1)]


class LlmUser(User):
    """One streaming request at a time per user."""

    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        self.rng = np.random.default_rng(random.getrandbits(32))
        self.grpc = None
        self.session = None
        if TRANSPORT == "grpc":
            import tritonclient.grpc as grpcclient

            self.responses: queue.Queue = queue.Queue()
            self.grpc = grpcclient.InferenceServerClient(GRPC_URL)
            self.grpc.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        else:  # http and openai
            import requests

            self.session = requests.Session()

    def on_stop(self) -> None:
        if self.grpc is not None:
            from manylora.client.api import close_client

            close_client(self.grpc)
        if self.session is not None:
            self.session.close()

    def _fire(self, name: str, start: float, length: int, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="grpc-stream" if self.grpc is not None else f"{TRANSPORT}-sse",
            name=name,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )

    @task
    def generate(self) -> None:
        adapter = choose_adapter(self.rng)
        prompt = ("Hello " * int(self.rng.integers(*INPUT_RANGE))).strip()
        max_tokens = int(self.rng.integers(*OUTPUT_RANGE))
        start = time.perf_counter()
        chars, first = 0, True
        try:
            stream = self._grpc_stream if self.grpc is not None else self._sse_stream
            if TRANSPORT == "openai":
                stream = self._openai_stream
            for piece in stream(prompt, adapter, max_tokens):
                if first and piece:
                    self._fire("ttft", start, 0)
                    first = False
                chars += len(piece)
        except Exception as e:  # noqa: BLE001 - every failure is a locust failure event
            self._fire("generate", start, chars, e)
            return
        self._fire("generate", start, chars)

    def _grpc_stream(self, prompt: str, adapter: str | None, max_tokens: int):
        import tritonclient.grpc as grpcclient

        from manylora.client.api import _sampling, _tensor

        inputs = [_tensor("text_input", [prompt], "BYTES")]
        inputs += _sampling(max_tokens, adapter, None, None, None, None, None, stream=True)
        self.grpc.async_stream_infer(
            "llm", inputs, outputs=[grpcclient.InferRequestedOutput("text_output")], enable_empty_final_response=True
        )
        while True:
            result, error = self.responses.get(timeout=TIMEOUT_S)
            if error is not None:
                raise RuntimeError(str(error))
            out = result.as_numpy("text_output")
            if out is not None and out.size:
                yield out.reshape(-1)[0].decode("utf-8", "replace")
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                return

    def _sse_events(self, path: str, body: dict):
        """The JSON events of a server-sent-event stream (Triton's generate_stream, the front's), until [DONE];
        an event with an error raises."""
        with self.session.post(f"{self.host.rstrip('/')}{path}", json=body, stream=True, timeout=TIMEOUT_S) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            for line in reply.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    raise RuntimeError(error.get("message", error) if isinstance(error, dict) else error)
                yield event

    def _sse_stream(self, prompt: str, adapter: str | None, max_tokens: int):
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True}
        if adapter:
            body["lora_name"] = adapter
        for event in self._sse_events("/v2/models/llm/generate_stream", body):
            yield event.get("text_output", "")

    def _openai_stream(self, prompt: str, adapter: str | None, max_tokens: int):
        body = {"model": adapter or (BASE_MODEL[0] if BASE_MODEL else ""), "max_tokens": max_tokens, "stream": True}
        if OPENAI_ENDPOINT == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = f"/v1/{'chat/completions' if OPENAI_ENDPOINT == 'chat' else 'completions'}"
        for event in self._sse_events(path, body):
            for choice in event.get("choices", ()):
                yield choice.get("text") or (choice.get("delta") or {}).get("content") or ""

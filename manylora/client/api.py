"""ManyLoraClient: generate with a per-request adapter, stream tokens, list adapters, read stats."""

from __future__ import annotations

import contextlib
import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ENSEMBLE = "llm"
GENERATOR = "generator"


class ManyLoraError(Exception):
    """The server refused or failed a request; ``message`` is the server's own text."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass
class GenerateResult:
    text: str
    lora_version: str  # sha256 of the adapter weights that served it; "" for the base model


def _tensor(name: str, values: Sequence, dtype: str) -> grpcclient.InferInput:
    """One request's input with the batch dimension the models expect: shape [1, n]."""
    np_dtype = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
    array = np.array([list(values)], dtype=np_dtype[dtype])
    if dtype == "BYTES":
        array = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in values]], dtype=np.object_)
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _sampling(
    max_tokens: int,
    adapter: str | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    stop: Sequence[str] | None,
    stream: bool,
) -> list[grpcclient.InferInput]:
    inputs = [_tensor("max_tokens", [max_tokens], "INT32"), _tensor("stream", [stream], "BOOL")]
    if adapter:
        inputs.append(_tensor("lora_name", [adapter], "BYTES"))
    if temperature is not None:
        inputs.append(_tensor("temperature", [temperature], "FP32"))
    if top_k is not None:
        inputs.append(_tensor("top_k", [top_k], "INT32"))
    if top_p is not None:
        inputs.append(_tensor("top_p", [top_p], "FP32"))
    if seed is not None:
        inputs.append(_tensor("seed", [seed], "UINT64"))
    if stop:
        inputs.append(_tensor("stop", list(stop), "BYTES"))
    return inputs


class ManyLoraClient:
    """Client of a manylora Triton server.

    Args:
        grpc_url: host:port of the gRPC endpoint (streaming, the generator model).
        http_url: host:port (or http://host:port) of the HTTP endpoint (generate).
        timeout: seconds to wait for each response before giving up.
    """

    def __init__(self, grpc_url: str = "localhost:8001", http_url: str = "localhost:8000", timeout: float = 300.0):
        self.grpc_url = grpc_url
        self.http_url = http_url if http_url.startswith("http") else f"http://{http_url}"
        self.timeout = timeout

    # -- text through the `llm` ensemble ---------------------------------------------------

    def stream(
        self,
        prompt: str,
        adapter: str | None = None,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Text pieces as the server releases them (gRPC ModelStreamInfer on `llm`)."""
        inputs = [_tensor("text_input", [prompt], "BYTES")]
        inputs += _sampling(max_tokens, adapter, temperature, top_k, top_p, seed, stop, stream=True)
        for response in self._stream_infer(ENSEMBLE, inputs, ["text_output"]):
            text = response.as_numpy("text_output")
            piece = text.reshape(-1)[0].decode("utf-8") if text is not None and text.size else ""
            if piece:
                yield piece

    def generate(self, prompt: str, adapter: str | None = None, max_tokens: int = 64, **kwargs) -> str:
        """The whole continuation in one HTTP call (POST /v2/models/llm/generate)."""
        return self.generate_result(prompt, adapter, max_tokens, **kwargs).text

    def generate_result(
        self,
        prompt: str,
        adapter: str | None = None,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> GenerateResult:
        body: dict = {"text_input": prompt, "max_tokens": max_tokens, "stream": False}
        optional = {"lora_name": adapter, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        body.update({k: v for k, v in optional.items() if v not in (None, "")})
        if stop:
            body["stop"] = list(stop)
        reply = self._post(f"/v2/models/{ENSEMBLE}/generate", body)
        return GenerateResult(text=reply.get("text_output", ""), lora_version=reply.get("lora_version", ""))

    # -- token ids through the `generator` model -------------------------------------------

    def generate_ids(
        self,
        input_ids: Sequence[int],
        adapter: str | None = None,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stream: bool = False,
    ) -> list[int]:
        """Output token ids for prompt token ids (the generator model, gRPC streaming)."""
        inputs = [_tensor("input_ids", list(input_ids), "INT32")]
        inputs += _sampling(max_tokens, adapter, temperature, top_k, top_p, seed, stop, stream=stream)
        ids: list[int] = []
        for response in self._stream_infer(GENERATOR, inputs, ["output_ids"]):
            out = response.as_numpy("output_ids")
            if out is not None:
                ids.extend(int(t) for t in out.reshape(-1))
        return ids

    def list_adapters(self) -> list[dict]:
        """The adapters the running server knows: name, status ("ready", or "refused" with its reason), rank,
        target_modules, sha256, layers (and path, where the operator set list_adapter_paths)."""
        return self._control({"op": "list_adapters"})["adapters"]

    def stats(self) -> dict:
        """The engine's counters (JSON)."""
        return self._control({"op": "stats"})

    def load_adapter(self, name: str, path: str, sha256: str | None = None, replace: bool = False) -> dict:
        """Register adapter ``name`` from ``path`` (a PEFT directory on the server's machine).

        ``sha256`` pins the weights (refused if they differ); ``replace`` re-versions a registered
        name (requests already admitted finish on the old version). Returns the adapter's info
        (name, rank, target_modules, sha256, layers). Needs MANYLORA_ALLOW_RUNTIME_ADAPTERS=1 on
        the server; otherwise ManyLoraError with status UNSUPPORTED.
        """
        command = {"op": "load_adapter", "name": name, "path": str(path), "replace": bool(replace)}
        if sha256:
            command["sha256"] = sha256
        return self._control(command)

    def unload_adapter(self, name: str) -> dict:
        """Unregister adapter ``name``: new requests for it get NOT_FOUND; admitted ones finish."""
        return self._control({"op": "unload_adapter", "name": name})

    # -- plumbing ---------------------------------------------------------------------------

    def _control(self, command: dict) -> dict:
        inputs = [_tensor("control", [json.dumps(command)], "BYTES")]
        for response in self._stream_infer(GENERATOR, inputs, ["control_output"]):
            out = response.as_numpy("control_output")
            if out is not None and out.size:
                return json.loads(out.reshape(-1)[0].decode("utf-8"))
        raise ManyLoraError(f"no answer to control request {command}")

    def _stream_infer(self, model: str, inputs: list, outputs: list[str]) -> Iterator[grpcclient.InferResult]:
        """Responses of one request until the FINAL flag; an error response raises."""
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
            client.async_stream_infer(model, inputs, outputs=requested, enable_empty_final_response=True)
            while True:
                try:
                    result, error = results.get(timeout=self.timeout)
                except queue.Empty:
                    raise ManyLoraError(f"no response from '{model}' within {self.timeout} s") from None
                if error is not None:
                    raise ManyLoraError(_message(error), _status(error))
                yield result
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    return
        finally:
            close_client(client)

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.http_url + path, data=json.dumps(body).encode("utf-8"), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            with contextlib.suppress(json.JSONDecodeError, AttributeError):
                text = json.loads(text).get("error", text)
            raise ManyLoraError(text, str(e.code)) from None
        except urllib.error.URLError as e:
            raise ManyLoraError(f"cannot reach {self.http_url}: {e.reason}") from None


def close_client(client: grpcclient.InferenceServerClient) -> None:
    """Stop a tritonclient gRPC client's stream and close its channel, once.

    tritonclient closes the channel again from ``__del__``; when that runs at interpreter exit under
    gevent (locust), grpc's close can block forever (seen as a locust process that never exits).
    """
    try:
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
        client.close = lambda: None  # what __del__ calls


def _message(error: Exception) -> str:
    if isinstance(error, InferenceServerException):
        return error.message() or str(error)
    return str(error)


def _status(error: Exception) -> str | None:
    return error.status() if isinstance(error, InferenceServerException) else None

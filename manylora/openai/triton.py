"""The Triton server, seen from the front: one shared asyncio gRPC client (tritonclient.grpc.aio).

A generation is one ``ModelStreamInfer`` call on the ``llm`` ensemble: the request goes out, the
client half-closes, and the responses arrive as the engine releases them until the server ends the
call after the last one. Each response is read straight from its protobuf (a few bytes per output,
no numpy), so the Python per chunk is small. Leaving the iterator early (the HTTP client went away,
a stop) cancels the call, and the server stops the request in the engine (docs/security.md).
Control requests (list_adapters, stats, model_info, load/unload) go to the ``generator`` the same way.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from manylora.openai.errors import OpenAIError, from_server

ENSEMBLE = "llm"
GENERATOR = "generator"
OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", "finish_reason", "lora_version")
_NP = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}


@dataclass(frozen=True, slots=True)
class Generation:
    """One generation as the ``llm`` ensemble takes it (translate.py builds it from an OpenAI request)."""

    prompt: str
    max_tokens: int
    adapter: str | None = None  # None: the base model
    temperature: float | None = None  # None: the server's default (greedy)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    add_special_tokens: bool = True
    ignore_eos: bool = False
    stream: bool = True


@dataclass(frozen=True, slots=True)
class Chunk:
    """One response of the ``llm`` ensemble."""

    text: str
    input_tokens: int  # the prompt's length
    output_tokens: int  # the tokens this response accounts for (a request's add up to all it generated)
    finish_reason: str  # "stop" | "length" on the last response, else ""
    lora_version: str  # the sha256 of the adapter that served it; "" for the base model


def _tensor(name: str, values: list, datatype: str) -> grpcclient.InferInput:
    array = np.array([values], dtype=_NP[datatype])
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def llm_inputs(gen: Generation) -> tuple[list[grpcclient.InferInput], dict | None]:
    """The ``llm`` inputs for ``gen`` (with the batch dimension), and the request parameters (ignore_eos travels
    in vLLM's ``sampling_parameters``, which the generator reads)."""
    inputs = [_tensor("text_input", [gen.prompt.encode("utf-8")], "BYTES"),
              _tensor("max_tokens", [gen.max_tokens], "INT32"),
              _tensor("stream", [gen.stream], "BOOL")]
    if gen.adapter:
        inputs.append(_tensor("lora_name", [gen.adapter.encode("utf-8")], "BYTES"))
    if gen.temperature is not None:
        inputs.append(_tensor("temperature", [gen.temperature], "FP32"))
    if gen.top_p is not None:
        inputs.append(_tensor("top_p", [gen.top_p], "FP32"))
    if gen.top_k:
        inputs.append(_tensor("top_k", [gen.top_k], "INT32"))
    if gen.seed is not None:
        inputs.append(_tensor("seed", [gen.seed], "UINT64"))
    if gen.stop:
        inputs.append(_tensor("stop", [s.encode("utf-8") for s in gen.stop], "BYTES"))
    if not gen.add_special_tokens:
        inputs.append(_tensor("add_special_tokens", [False], "BOOL"))
    parameters = {"sampling_parameters": json.dumps({"ignore_eos": True})} if gen.ignore_eos else None
    return inputs, parameters


def _bytes_element(raw: bytes) -> bytes:
    """The one element of a serialized BYTES tensor (4-byte little-endian length, then the bytes)."""
    (size,) = struct.unpack_from("<I", raw)
    return raw[4:4 + size]


def read_chunk(response) -> Chunk:
    """A Chunk from a ModelInferResponse of ``llm`` (outputs in raw_output_contents, in the order of ``outputs``)."""
    values = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        values[output.name] = raw
    text = values.get("text_output")
    reason = values.get("finish_reason")
    version = values.get("lora_version")
    n_in, n_out = values.get("num_input_tokens"), values.get("num_output_tokens")
    return Chunk(
        text=_bytes_element(text).decode("utf-8") if text else "",
        input_tokens=int.from_bytes(n_in[:4], "little") if n_in else 0,
        output_tokens=int.from_bytes(n_out[:4], "little") if n_out else 0,
        finish_reason=_bytes_element(reason).decode("ascii") if reason else "",
        lora_version=_bytes_element(version).decode("ascii") if version else "",
    )


class TritonBackend:
    """The shared gRPC client and the calls the front makes through it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: grpcaio.InferenceServerClient | None = None
        self._outputs = [grpcclient.InferRequestedOutput(name) for name in OUTPUTS]

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        """The gRPC client, made on first use: a grpc.aio channel belongs to the event loop it is made in (the
        server's, not the one that built the application)."""
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def is_ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready()) and bool(await self.client.is_model_ready(ENSEMBLE))
        except Exception:  # noqa: BLE001 - not reachable is not ready
            return False

    async def generate(self, gen: Generation, request_id: str, model: str | None = None,
                       timeout_s: float | None = None) -> AsyncIterator[Chunk]:
        """The chunks of one generation; an error from the server raises OpenAIError (errors.from_server, naming
        ``model`` on a 404). Closing the iterator before the end cancels the request on the server."""
        inputs, parameters = llm_inputs(gen)
        request = {"model_name": ENSEMBLE, "inputs": inputs, "outputs": self._outputs, "request_id": request_id,
                   "parameters": parameters}
        call = self.client.stream_infer(_one(request), stream_timeout=timeout_s)
        try:
            async for result, error in call:
                if error is not None:
                    raise from_server(error.message(), model)
                yield read_chunk(result.get_response())
        except OpenAIError:
            raise
        except InferenceServerException as e:
            raise from_server(e.message() or str(e), model) from None
        except Exception as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _unavailable(self.url, e) from None
        finally:
            call.cancel()  # a no-op once the call has ended; otherwise the server stops the request

    async def control(self, command: dict) -> dict:
        """One control request to the generator (``{"op": ...}``); its JSON answer."""
        inputs = [_tensor("control", [json.dumps(command).encode("utf-8")], "BYTES")]
        request = {"model_name": GENERATOR, "inputs": inputs,
                   "outputs": [grpcclient.InferRequestedOutput("control_output")]}
        call = self.client.stream_infer(_one(request))
        answer = None
        try:
            async for result, error in call:
                if error is not None:
                    raise from_server(error.message())
                raw = dict(zip((o.name for o in result.get_response().outputs),
                               result.get_response().raw_output_contents, strict=False)).get("control_output")
                if raw:
                    answer = json.loads(_bytes_element(raw))
        except OpenAIError:
            raise
        except InferenceServerException as e:
            raise from_server(e.message() or str(e)) from None
        except Exception as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            raise _unavailable(self.url, e) from None
        finally:
            call.cancel()
        if answer is None:
            raise OpenAIError(502, f"no answer from the server to control request '{command.get('op')}'",
                              "server_error")
        return answer


async def _one(request: dict):
    yield request


def _unavailable(url: str, e: Exception) -> OpenAIError:
    """The error for a failed gRPC call: 504 past its deadline (--request-timeout), else 503."""
    detail, code = getattr(e, "details", None), getattr(e, "code", None)
    text = detail() if callable(detail) else str(e)
    if callable(code) and getattr(code(), "name", "") == "DEADLINE_EXCEEDED":
        return OpenAIError(504, f"the generation did not finish in time (request timeout): {text}", "server_error",
                           code="timeout")
    return OpenAIError(503, f"the Triton server at {url} cannot be reached: {text}", "server_error", code="unavailable")

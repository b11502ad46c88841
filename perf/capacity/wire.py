"""The gRPC messages of a capacity run: what each send asks the server for, and what each response counts.

A send to ``generator`` carries token ids and asks for ``output_ids`` (its tokens are the ids that come back). A
send to the ``llm`` ensemble carries the prompt as text and asks for what the OpenAI front asks for (the text, the
adapter's version, the token counts and the finish reason), so that its run costs the server what a user's
stream costs; its tokens are the ``num_output_tokens`` each response accounts for, exact whatever the text
(a special token decodes to nothing, a word may span two chunks).

Messages are the ones tritonclient's gRPC service defines (``tritonclient.grpc.service_pb2``), built before a
run starts and read on the stream's thread without tritonclient's wrapper (clients.py says why).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GENERATOR_OUTPUTS = ("output_ids",)
# what manylora.openai asks the ensemble for; the first is the text
LLM_OUTPUTS = ("text_output", "lora_version", "num_input_tokens", "num_output_tokens", "finish_reason")


@dataclass(frozen=True)
class SendSpec:
    """One send of a worker's share: what to send and when (seconds after the run's start)."""

    slot: int
    offset_s: float
    prompt_ids: tuple[int, ...]
    output_len: int
    adapter: str | None


@dataclass(frozen=True)
class RunSpec:
    """A worker's share of one run."""

    model: str  # "generator" (token ids) or "llm" (text)
    stream: bool
    ignore_eos: bool
    keep_ids: bool
    sends: list[SendSpec]

    @property
    def text(self) -> bool:
        return self.model != "generator"


@dataclass(frozen=True)
class ResponseCount:
    """What one response adds to its request: tokens, their ids (token-id runs only) and characters of text."""

    tokens: int
    ids: list[int]
    chars: int


def bytes_element(text: str) -> bytes:
    """``text`` as a one-element serialized BYTES tensor (4-byte little-endian length, then the bytes)."""
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def text_of_bytes_tensor(raw: bytes) -> str:
    """The first element of a serialized BYTES tensor (4-byte little-endian length, then the bytes)."""
    if len(raw) < 4:
        return ""
    (n,) = struct.unpack_from("<I", raw)
    return raw[4 : 4 + n].decode("utf-8", "replace")


def prompt_text(prompt_ids: tuple[int, ...]) -> str:
    """The text that perf/engine/checkpoint.py's word-level tokenizer turns back into these ids
    (id i is "w{i}", i >= 4)."""
    return " ".join(f"w{t}" for t in prompt_ids)


def build_request(pb, request_id: str, spec: SendSpec, run: RunSpec):
    """A ModelInferRequest with the batch dimension on every input ([1, n], [1, 1])."""
    r = pb.ModelInferRequest()
    r.model_name = run.model
    r.id = request_id

    def add(name: str, datatype: str, shape: list[int], raw: bytes) -> None:
        tensor = r.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.extend(shape)
        r.raw_input_contents.append(raw)

    if run.text:
        add("text_input", "BYTES", [1, 1], bytes_element(prompt_text(spec.prompt_ids)))
    else:
        add("input_ids", "INT32", [1, len(spec.prompt_ids)], np.asarray(spec.prompt_ids, dtype="<i4").tobytes())
    add("max_tokens", "INT32", [1, 1], np.asarray([spec.output_len], dtype="<i4").tobytes())
    add("stream", "BOOL", [1, 1], np.asarray([run.stream], dtype=np.bool_).tobytes())
    if run.ignore_eos and not run.text:
        add("ignore_eos", "BOOL", [1, 1], np.asarray([True], dtype=np.bool_).tobytes())
    elif run.ignore_eos:  # the ensemble has no ignore_eos input: the vLLM backend's form of it
        r.parameters["sampling_parameters"].string_param = '{"ignore_eos": true}'
    if spec.adapter:
        add("lora_name", "BYTES", [1, 1], bytes_element(spec.adapter))
    for name in LLM_OUTPUTS if run.text else GENERATOR_OUTPUTS:
        r.outputs.add().name = name
    r.parameters["triton_enable_empty_final_response"].bool_param = True
    return r


def count_response(response, text: bool) -> ResponseCount:
    """The tokens, ids and characters one ModelInferResponse carries (an empty final response: none).
    ``text``: a response of the ``llm`` ensemble (tokens from ``num_output_tokens``), else of ``generator``."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=False))
    if not text:
        ids = np.frombuffer(raw["output_ids"], dtype="<i4").tolist() if "output_ids" in raw else []
        return ResponseCount(len(ids), ids, 0)
    tokens = int(np.frombuffer(raw["num_output_tokens"], dtype="<u4")[0]) if "num_output_tokens" in raw else 0
    chars = len(text_of_bytes_tensor(raw["text_output"])) if "text_output" in raw else 0
    return ResponseCount(tokens, [], chars)

"""The generator's output tensors for one engine output chunk, only those the request asked for.

Only the requested ones are built because the Triton 2.51 Python backend stub prunes unrequested
outputs inside ResponseSender.send after releasing the GIL: dropping a numpy-backed tensor there
frees Python objects without the GIL, and the stub died of it (a segmentation fault on the H200,
2026-11-29, whenever a client asked for `output_ids` alone while other threads ran Python).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from manylora.engine.requests.types import GenerationOutput

# the engine's finish reasons as OpenAI and the vLLM backend name them
FINISH_REASONS = {"eos": b"stop", "stop": b"stop", "length": b"length"}


def _finish_reason(out: GenerationOutput) -> np.ndarray:
    reason = FINISH_REASONS.get(out.finish_reason or "", b"") if out.finished else b""
    return np.array([[reason]], dtype=np.object_)


# name -> its array for one chunk, with the batch dimension
_BUILDERS: dict[str, Callable[[GenerationOutput], np.ndarray]] = {
    "output_ids": lambda out: np.asarray(out.token_ids, dtype=np.int32).reshape(1, -1),
    "context_ids": lambda out: np.asarray(out.context_ids, dtype=np.int32).reshape(1, -1),
    "strip_chars": lambda out: np.array([[out.strip_chars]], dtype=np.int32),
    "lora_version": lambda out: np.array([[(out.adapter_sha256 or "").encode("utf-8")]], dtype=np.object_),
    "num_input_tokens": lambda out: np.array([[out.prompt_tokens]], dtype=np.uint32),
    "num_output_tokens": lambda out: np.array([[out.output_tokens]], dtype=np.uint32),
    "finish_reason": _finish_reason,
}
GENERATOR_OUTPUTS = tuple(_BUILDERS)


def is_requested(name: str, requested: frozenset[str]) -> bool:
    """Whether output ``name`` goes into the response: named by the request, or the request named none
    (Triton then fills in every output)."""
    return not requested or name in requested


def output_arrays(out: GenerationOutput, requested: frozenset[str]) -> list[tuple[str, np.ndarray]]:
    """(name, array) for each generator output the request asked for (``is_requested``), in
    GENERATOR_OUTPUTS order: output_ids / context_ids int32 [1, n], strip_chars int32 [1, 1],
    lora_version bytes [1, 1] (the adapter's sha256, empty for the base model), num_input_tokens uint32 [1, 1]
    (the prompt's length), num_output_tokens uint32 [1, 1] (the output tokens this response accounts for; a
    request's responses add up to all it generated), finish_reason bytes [1, 1] ("stop" or "length" on the last
    response, else empty)."""
    return [(name, build(out)) for name, build in _BUILDERS.items() if is_requested(name, requested)]

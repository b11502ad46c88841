"""The generator's output tensors for one engine output chunk, only those the request asked for.

Only the requested ones are built because the Triton 2.51 Python backend stub prunes unrequested
outputs inside ResponseSender.send after releasing the GIL: dropping a numpy-backed tensor there
frees Python objects without the GIL, and the stub died of it (a segmentation fault on the H200,
2026-11-29, whenever a client asked for `output_ids` alone while other threads ran Python).
"""

from __future__ import annotations

import numpy as np

from backend.request import GenerationOutput

GENERATOR_OUTPUTS = ("output_ids", "context_ids", "strip_chars", "lora_version")


def output_arrays(out: GenerationOutput, requested: frozenset[str] | set[str]) -> list[tuple[str, np.ndarray]]:
    """(name, array) for each generator output in ``requested``, in GENERATOR_OUTPUTS order, each
    with the batch dimension: output_ids / context_ids int32 [1, n], strip_chars int32 [1, 1],
    lora_version bytes [1, 1] (the adapter's sha256, empty for the base model). An empty
    ``requested`` means all of them (Triton fills in every output when a client names none)."""
    wanted = [name for name in GENERATOR_OUTPUTS if not requested or name in requested]
    arrays = []
    for name in wanted:
        if name == "output_ids":
            arrays.append((name, np.asarray(out.token_ids, dtype=np.int32).reshape(1, -1)))
        elif name == "context_ids":
            arrays.append((name, np.asarray(out.context_ids, dtype=np.int32).reshape(1, -1)))
        elif name == "strip_chars":
            arrays.append((name, np.array([[out.strip_chars]], dtype=np.int32)))
        else:
            arrays.append((name, np.array([[(out.adapter_sha256 or "").encode("utf-8")]], dtype=np.object_)))
    return arrays

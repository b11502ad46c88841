"""The generator builds only the outputs a request asked for (the 2.51 stub crashed pruning the rest)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from manylora.engine.requests.response_tensors import GENERATOR_OUTPUTS, output_arrays
from manylora.engine.requests.types import GenerationOutput


def _random_output(rng: random.Random) -> GenerationOutput:
    return GenerationOutput(
        request_id=f"r{rng.randrange(1000)}",
        token_ids=[rng.randrange(128256) for _ in range(rng.randrange(0, 6))],
        context_ids=[rng.randrange(128256) for _ in range(rng.randrange(0, 4))],
        strip_chars=rng.randrange(0, 5),
        adapter_sha256=rng.choice([None, f"{rng.getrandbits(256):064x}"]),
    )


@pytest.mark.parametrize("size", range(len(GENERATOR_OUTPUTS) + 1))
def test_only_the_requested_outputs_in_declared_order(size):
    rng = random.Random(size)
    for requested in itertools.combinations(GENERATOR_OUTPUTS, size):
        out = _random_output(rng)
        shuffled = list(requested)
        rng.shuffle(shuffled)
        arrays = dict(output_arrays(out, frozenset(shuffled)))
        expected = list(requested) if requested else list(GENERATOR_OUTPUTS)  # none named: all
        assert list(arrays) == expected
        if "output_ids" in arrays:
            assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].tolist() == [out.token_ids]
        if "context_ids" in arrays:
            assert arrays["context_ids"].dtype == np.int32 and arrays["context_ids"].tolist() == [out.context_ids]
        if "strip_chars" in arrays:
            assert arrays["strip_chars"].tolist() == [[out.strip_chars]]
        if "lora_version" in arrays:
            assert arrays["lora_version"].tolist() == [[(out.adapter_sha256 or "").encode()]]


def test_unknown_requested_names_are_ignored():
    out = _random_output(random.Random(7))
    assert [name for name, _ in output_arrays(out, frozenset({"output_ids", "control_output"}))] == ["output_ids"]

"""The zero-copy safetensors reader against the safetensors library, and its refusals."""

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from manylora.engine.safetensors_view import parse_safetensors


def test_same_tensors_as_the_library():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "c": torch.randn(2, 3, 1, generator=gen).to(torch.float16),
        "d": torch.randint(-5, 5, (4,), generator=gen, dtype=torch.int64),
        "e": torch.zeros(0, 3),
        "f": torch.randn(1, generator=gen).to(torch.float64),
    }
    data = save(tensors, metadata={"format": "pt"})
    ours = parse_safetensors(bytearray(data))
    theirs = load(data)
    assert ours.keys() == theirs.keys() == tensors.keys()
    for k in tensors:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        assert torch.equal(ours[k], theirs[k])


def _file(header: dict, payload: bytes = b"") -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(raw)) + raw + payload)


@pytest.mark.parametrize("buf, match", [
    (bytearray(b"\x01\x02"), "shorter than"),
    (bytearray(struct.pack("<Q", 10**9) + b"{}"), "does not fit"),
    (bytearray(struct.pack("<Q", 3) + b"{x}"), "not valid JSON"),
    (_file({"t": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "bad header entry"),
    (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "do not hold"),
    (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "do not hold"),
    (_file({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}), "negative"),
])  # fmt: skip
def test_malformed_files_are_refused(buf, match):
    with pytest.raises(ValueError, match=match):
        parse_safetensors(buf)

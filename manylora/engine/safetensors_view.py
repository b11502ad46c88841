"""Tensors of a safetensors file held in memory, as zero-copy views of its bytes.

The adapter loader hashes a file's bytes and then needs its tensors. Parsing the format here
(an 8-byte header length, a JSON header, the raw data) makes each tensor a view of the buffer
already read: no second copy, and no long call that holds the GIL while the engine thread
launches kernels (safetensors.torch.load copies every tensor inside one call).
"""

from __future__ import annotations

import json
import struct

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # as the safetensors library


def data_section(buf, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole data section of a parsed file as one flat ``dtype`` view (None if it does not divide
    evenly): one finiteness check over every tensor, when they all share that dtype."""
    (header_len,) = struct.unpack("<Q", bytes(buf[:8]))
    start = 8 + header_len
    if start % dtype.itemsize or (len(buf) - start) % dtype.itemsize or len(buf) == start:
        return None
    return torch.frombuffer(buf, dtype=dtype, offset=start, count=(len(buf) - start) // dtype.itemsize)


def parse_safetensors(buf) -> dict[str, torch.Tensor]:
    """name -> tensor viewing ``buf`` (a writable buffer: bytearray, or a copy-on-write mmap), which
    must stay alive and unchanged while they are used.

    Raises ValueError naming what is malformed: the header length or JSON, a dtype, a shape
    that disagrees with its byte range, or a range outside the data.
    """
    if len(buf) < 8:
        raise ValueError(f"file of {len(buf)} bytes is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", bytes(buf[:8]))
    if header_len > min(MAX_HEADER_BYTES, len(buf) - 8):
        raise ValueError(f"header length {header_len} does not fit the file of {len(buf)} bytes")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data_start, data_len = 8 + header_len, len(buf) - 8 - header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor '{name}': bad header entry {info!r} ({e})") from None
        numel = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"tensor '{name}': negative dimension in shape {shape}")
            numel *= d
        size = numel * dtype.itemsize
        if not 0 <= begin <= end <= data_len or end - begin != size:
            raise ValueError(f"tensor '{name}': bytes [{begin}, {end}) do not hold {dtype} {shape} "
                             f"({size} bytes) inside the {data_len} data bytes")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=data_start + begin)
        tensors[name] = flat.view(dtype).view(shape) if (data_start + begin) % dtype.itemsize == 0 else \
            flat.clone().view(dtype).view(shape)
    return tensors

"""A step's block tables (each sequence's KV pages) as one padded int32 host tensor, built without a Python list
per row: at 256 sequences the nested-list ``torch.tensor`` took ~0.7 ms of the engine thread per step, this ~0.2."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch


def padded_block_tables(tables: list[list[int]], fill: int) -> torch.Tensor:
    """int32 [len(tables), longest table] on the host: row i is tables[i], then ``fill`` to the width."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if len(tables) else 0
    out = np.full((len(tables), width), fill, dtype=np.int32)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int32,
                                                           count=int(lengths.sum()))
    return torch.from_numpy(out)

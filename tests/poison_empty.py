"""Uninitialised memory as a GPU gives it, for the tests on the CPU (``MANYLORA_POISON_EMPTY=1``, tests/conftest.py).

On the CPU a fresh ``torch.empty`` is mostly zeros (new pages from the OS); on a GPU the caching allocator hands
back whatever the last owner of the block left, and a CUDA graph's replays reuse its memory pool the same way. A
kernel or launcher that reads an element nobody wrote (a table's padding, a row of the shrink's output that the
expand should skip) then gets a stale value: as an index, an illegal memory access on the GPU and, with zeros, a
silent pass on the CPU. Inside ``poisoned_empty()``, every tensor made by the Python-level empty constructors is
filled first: floats with NaN, integers with a large positive value (an index past any tensor: the bounds check
of ``tests/kernels/memory_bounds.py`` then names the read, under the interpreter), booleans with True.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

POISON_INT = 2**30 - 3  # odd and far past every test tensor: as an element offset it lands outside them all


def poison(t: torch.Tensor) -> torch.Tensor:
    """t filled with the poison of its dtype, in place (returned)."""
    if t.numel() == 0:
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype in (torch.uint8, torch.int8, torch.int16):
        t.fill_(torch.iinfo(t.dtype).max)
    else:
        t.fill_(POISON_INT)
    return t


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """torch.empty / empty_like / empty_strided / Tensor.new_empty return poisoned tensors while inside."""
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    new_empty = torch.Tensor.new_empty

    def wrap(fn):
        def poisoned(*args, **kwargs):
            return poison(fn(*args, **kwargs))

        return poisoned

    try:
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        torch.Tensor.new_empty = wrap(new_empty)
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = new_empty

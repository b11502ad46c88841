"""The interpreter's bounds check (memory_bounds.py, on for every kernel test) catches what the GPU would fault on."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import _interpreting


@triton.jit
def _shifted_copy(x_ptr, out_ptr, counter_ptr, n, LOAD_SHIFT: tl.constexpr, STORE_SHIFT: tl.constexpr,
                  ATOMIC_SHIFT: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, 16)
    mask = offs < n
    x = tl.load(x_ptr + offs + LOAD_SHIFT, mask=mask, other=0.0)
    tl.store(out_ptr + offs + STORE_SHIFT, x, mask=mask)
    tl.atomic_add(counter_ptr + ATOMIC_SHIFT, 1)


@pytest.fixture(autouse=True)
def _interpreted_only():
    if not _interpreting():
        pytest.skip("the check runs under the interpreter (on the GPU an out-of-bounds access faults by itself)")


def _launch(n: int, load: int = 0, store: int = 0, atomic: int = 0) -> None:
    x, out, counter = torch.randn(n), torch.empty(n), torch.zeros(1, dtype=torch.int32)
    _shifted_copy[(1,)](x, out, counter, n, LOAD_SHIFT=load, STORE_SHIFT=store, ATOMIC_SHIFT=atomic)
    if not (load or store or atomic):
        assert torch.equal(out, x) and int(counter) == 1


def test_in_bounds_accesses_pass():
    for n in (1, 7, 16):
        _launch(n)


@pytest.mark.parametrize("shift, kind, where", [
    ({"load": 1}, "load", "4 bytes beyond the end of x_ptr"), ({"load": -2}, "load", "8 bytes before x_ptr"),
    ({"store": 3}, "store", "beyond the end of out_ptr"), ({"atomic": 1}, "atomic", "beyond the end of counter_ptr")])
def test_an_access_outside_every_argument_fails_naming_it(shift, kind, where):
    with pytest.raises(Exception, match=f"_shifted_copy program \\(0, 0, 0\\): a {kind} of 4 bytes .*{where}"):
        _launch(10, **shift)


def test_masked_off_lanes_are_not_accesses():
    """Lanes past n point outside the tensor but are masked off: no access, as on the GPU."""
    _launch(3)


@triton.jit
def _gather(table_ptr, x_ptr, out_ptr, n):
    offs = tl.arange(0, 16)
    mask = offs < n
    index = tl.load(table_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, tl.load(x_ptr + index, mask=mask, other=0.0), mask=mask)


def test_a_table_nobody_wrote_is_stale_memory_under_the_poison():
    """A gather through a table the launcher forgot to fill: zeros (a pass) from a fresh CPU allocation, a read
    far past x once torch.empty hands out stale memory as the GPU's allocator does (poison_empty.py)."""
    from poison_empty import POISON_INT, poisoned_empty

    x, constructors = torch.randn(8), (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty)
    with poisoned_empty():
        table = torch.empty(4, dtype=torch.int32)  # meant to be filled, and not
        assert int(table[0]) == POISON_INT and torch.isnan(torch.empty(2)).all()
        assert bool(torch.empty_like(table, dtype=torch.bool).all()) and int(table.new_empty(1)[0]) == POISON_INT
        with pytest.raises(Exception, match="_gather program \\(0, 0, 0\\): a load of 4 bytes .*beyond the end of"):
            _gather[(1,)](table, x, torch.zeros(4), 4)
    assert (torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty) == constructors  # restored

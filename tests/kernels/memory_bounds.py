"""Out-of-bounds memory accesses of Triton kernels, caught under the interpreter.

Triton's interpreter reads and writes whatever address a kernel computes: a load past a tensor's end returns
garbage from the host heap instead of faulting as the GPU does (an "illegal memory access" that kills the CUDA
context). Inside ``bounds_checked()``, every launch records the storages of its tensor arguments, and every load,
store and atomic whose mask is set must fall inside one of them; otherwise the access raises ``OutOfBounds``, naming
the kernel, the program and the address's distance from the nearest argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from triton.runtime import interpreter


class OutOfBounds(AssertionError):
    """A masked-in access outside every tensor argument of the launch."""


_launch: list[tuple[str, list[tuple[int, int, str]]]] = []  # (kernel, [(start, end, argument)]) of running launches


def _storages(name: str, arg: object, out: list[tuple[int, int, str]]) -> None:
    if isinstance(arg, torch.Tensor):
        storage = arg.untyped_storage()
        out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), name))
    elif isinstance(arg, tuple):
        for i, item in enumerate(arg):
            _storages(f"{name}[{i}]", item, out)


def _check(kind: str, ptrs, mask) -> None:
    if not _launch:
        return
    kernel, ranges = _launch[-1]
    addresses = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
    live = np.ones_like(addresses, dtype=bool) if mask is None else np.asarray(mask.data, dtype=bool).reshape(-1)
    if live.shape != addresses.shape:
        live = np.broadcast_to(live, addresses.shape)
    addresses = addresses[live]
    if addresses.size == 0:
        return
    width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end, _ in ranges:
        inside |= (addresses >= start) & (addresses + width <= end)
    if inside.all():
        return
    bad = int(addresses[~inside][0])
    start, end, arg = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
    where = f"{bad + width - end} bytes beyond the end of" if bad >= start else f"{start - bad} bytes before"
    grid_idx = interpreter.interpreter_builder.grid_idx
    raise OutOfBounds(f"{kernel} program {grid_idx}: a {kind} of {width} bytes at {bad:#x} is {where} {arg} "
                      f"({end - start} bytes); {int((~inside).sum())} of {addresses.size} masked-in addresses are "
                      f"outside every argument")


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Every interpreted kernel launch inside checks its loads, stores and atomics against its tensor arguments."""
    builder = interpreter.InterpreterBuilder
    executor = interpreter.GridExecutor
    saved = {name: getattr(builder, name) for name in (
        "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    saved_call = executor.__call__

    def call(self, *args, **kwargs):
        ranges: list[tuple[int, int, str]] = []
        names = list(self.arg_names)
        for i, arg in enumerate(args):
            _storages(names[i] if i < len(names) else f"arg{i}", arg, ranges)
        for key, arg in kwargs.items():
            _storages(key, arg, ranges)
        _launch.append((getattr(self.fn, "__name__", "kernel"), ranges))
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            _launch.pop()

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check("load", ptrs, mask)
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check("store", ptrs, mask)
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _check("atomic", ptr, mask)
        return saved["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check("atomic", ptr, None)
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    executor.__call__ = call
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)
        executor.__call__ = saved_call

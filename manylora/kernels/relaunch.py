"""Launching one compiled Triton kernel again and again without Triton's per-call dispatch.

``kernel[grid](*args, **meta)`` binds the arguments, specialises them, hashes a cache key, looks up
the compiled kernel and checks the globals it used before it launches: about 65 us of host time a
call on the H200 host (``perf.engine.profile_engine --python-profile``), where the launch itself takes
about 20. An eager step of the 8B model launches ~400 Triton kernels (256 of them LoRA), and
eager steps are bound by the host. A ``Relauncher`` goes through that dispatch for the first call
with a given argument signature and keeps the compiled kernel it returns; later calls with the
same signature (the same ints, tensor dtypes, devices and 16-byte alignments: everything Triton
specialises on, and more) launch it directly, the way ``JITFunction.run`` does after its lookup.

The direct path is taken only where it is known to match: a compiled kernel (not the
interpreter), a Triton whose ``JITFunction.run`` passes every bound argument to the launcher
(3.3 and later), and kernels whose compile-time parameters are all given in ``meta``.
``MANYLORA_TRITON_RELAUNCH=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
import triton

try:  # Triton >= 3.3: launch hooks live in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: always dispatch
    _knobs = None

_COMPILED_MAX = 4096  # argument signatures kept per Relauncher
ENABLED = os.environ.get("MANYLORA_TRITON_RELAUNCH", "1").strip().lower() not in ("0", "false", "off", "no")


class Relauncher:
    """Launches of ``fn`` with fixed compile-time parameters ``meta`` (constexprs and launch options such as
    num_warps); the runtime arguments are positional, in the kernel's parameter order."""

    def __init__(self, fn: triton.runtime.JITFunction, meta: dict[str, object]) -> None:
        self.fn = fn
        self.meta = meta
        self._compiled: dict[tuple, object] = {}
        self._tail: tuple | None = None  # the constexpr values, in parameter order after the positional ones
        self._direct = ENABLED and _knobs is not None and isinstance(fn, triton.runtime.JITFunction)
        self.direct_launches = 0  # launches that skipped the dispatch (tests and profiles read it)

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if not self._direct:
            self.fn[grid](*args, **self.meta)
            return
        key = tuple((a.dtype, a.get_device(), a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args)
        kernel = self._compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **self.meta)
            tail = self._constexpr_tail(len(args))
            if kernel is not None and hasattr(kernel, "run") and tail is not None:
                if len(self._compiled) >= _COMPILED_MAX:  # signatures that never repeat (a long-lived shared one)
                    self._compiled.clear()
                self._compiled[key], self._tail = kernel, tail
            return
        driver = triton.runtime.driver.active
        stream = driver.get_current_stream(driver.get_current_device())
        full = (*args, *self._tail)
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *full),
                   _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *full)
        self.direct_launches += 1

    def _constexpr_tail(self, num_positional: int) -> tuple | None:
        """meta's values for the parameters after the positional ones, or None (then every call dispatches) when
        those are not exactly the kernel's constexprs, all given in meta."""
        params = self.fn.params[num_positional:]
        if not all(p.is_constexpr and p.name in self.meta for p in params):
            return None
        if any(p.is_constexpr for p in self.fn.params[:num_positional]):
            return None
        return tuple(self.meta[p.name] for p in params)


_SHARED: dict[tuple, Relauncher] = {}
_SHARED_MAX = 1024


def relauncher(fn: triton.runtime.JITFunction, **meta: object) -> Relauncher:
    """A process-wide ``Relauncher`` of ``fn`` with ``meta``: for launchers called per layer without a prepared
    launch (the norms, silu * up, paged attention), and for the prepared LoRA launches, so that the compiled kernels
    they found outlive the step that prepared them (a step's first launch of a signature seen before skips the
    dispatch too)."""
    key = (fn, tuple(meta.items()))
    shared = _SHARED.get(key)
    if shared is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        shared = _SHARED[key] = Relauncher(fn, meta)
    return shared

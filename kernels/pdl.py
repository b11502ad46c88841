"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and later).

A captured decode step is ~600 kernels in a row, each waiting for the one before it to finish before the GPU even
starts launching it: about 1.3 us between kernels on the H200 (perf/results/2026-12-01-h200/14_fuse: 0.77 ms of an
8.9 ms step). A kernel launched with PDL is scheduled while its predecessor still runs; it then waits in
``griddepcontrol.wait`` until the predecessor has finished and its writes are visible, and tells its own successor
it may be scheduled (``griddepcontrol.launch_dependents``) as soon as its programs start.

Every kernel here calls ``grid_dependency_wait`` before its first memory access, so a PDL launch reads and writes
exactly what a plain launch would, after the previous kernel in the stream has completed: only the launch latency
overlaps. ``MANYLORA_PDL=1`` turns it on (``launch_meta`` then adds nothing but ``PDL=False``); on the CPU, under
the interpreter, before sm_90 or with a Triton without the launch option it is off anyway.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["ENABLED", "grid_dependency_wait", "launch_meta"]

ENABLED = os.environ.get("MANYLORA_PDL", "0").strip().lower() not in ("0", "false", "off", "no")


@functools.lru_cache(maxsize=16)
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_meta(device: torch.device) -> dict[str, object]:
    """The compile-time parameter ``PDL`` and, where it is on, the ``launch_pdl`` launch option, for a kernel launched
    on ``device`` (read at each call, so that a benchmark may flip ``ENABLED`` between captures)."""
    on = ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None else 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def grid_dependency_wait(PDL: tl.constexpr):
    """With PDL: let the next kernel be scheduled, then wait for the previous one to complete (its writes visible).
    Called first in each kernel, before any memory access."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

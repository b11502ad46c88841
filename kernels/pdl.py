"""Programmatic dependent launch (PDL, Hopper and later) between a LoRA shrink and the base GEMM after it.

A kernel launched with PDL may be scheduled before the kernel ahead of it in its stream has finished: as soon as
every program of that kernel has called ``griddepcontrol.launch_dependents`` (or exited). It must then call
``griddepcontrol.wait`` before it reads anything the kernel ahead writes; the wait returns once that kernel has
completed and its writes are visible. The fused LoRA GEMM (``kernels/skinny_gemm.py`` with a ``GemmLora``) uses this
to stream its base weight while the shrink of the same projection runs, and waits only before its LoRA tail, the
one part that reads the shrink's output. Its input x was written before the shrink started (the shrink is launched
without PDL, so it starts after everything ahead of it), so the GEMM may read x at once.

Off on the CPU, under the interpreter, before sm_90, with a Triton without the launch option, and with
``MANYLORA_PDL=0`` (the benchmark's A/B): the two kernels then run one after the other, with the same results.
An earlier experiment (commit 013e1bc, perf/results/2026-12-01-h200/15_pdl) made every decode kernel wait first
thing, which overlapped launch latency only and gained within the noise; here the GEMM's weight stream overlaps.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["ENABLED", "pdl_supported"]

ENABLED = os.environ.get("MANYLORA_PDL", "1").strip().lower() not in ("0", "false", "off", "no")


@functools.lru_cache(maxsize=16)
def _device_supports(device_index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL now (``ENABLED`` is read at each call, so that a benchmark may flip it
    between captures)."""
    if not ENABLED or device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off", "no"):
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())

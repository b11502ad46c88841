"""Child processes of the engine (tensor-parallel ranks, adapter loaders), started by spawn."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def python_for_children() -> str:
    """The interpreter to spawn children with: this one, or (inside Triton's Python backend stub,
    whose executable is not Python) the python3 of the environment it runs in."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else (shutil.which("python3") or sys.executable)


def spawn_context():
    """A spawn multiprocessing context (fork is unsafe in a process with threads and CUDA)."""
    import torch

    ctx = torch.multiprocessing.get_context("spawn")
    ctx.set_executable(python_for_children())
    return ctx

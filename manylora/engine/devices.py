"""Which device an engine runs on, and what runs there: the device name, Triton kernels or torch ops,
adapter loader processes."""

from __future__ import annotations

import os


def default_load_processes(device: str) -> int:
    """Adapter loader processes when unset: none on the CPU (the forward is the computation, loader
    threads use its GIL gaps); on CUDA a quarter of the cores, 1 to 4."""
    if not device.startswith("cuda"):
        return 0
    return max(1, min(4, (os.cpu_count() or 4) // 4))


def resolve_device(name: str) -> str:
    import torch  # here, so that the Triton model file can place an engine without importing torch

    if name in ("auto", ""):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' asked for, but torch sees no CUDA device")
    return name


def instance_device(requested: str, instance_kind: str = "", device_id: str | int | None = None) -> str:
    """The device for a Triton model instance's engine: ``requested`` unless it is "auto"; else the
    GPU Triton placed the instance on (instance_group KIND_GPU: one engine, one pool per GPU); else
    "auto" as resolve_device reads it (cuda if torch sees one)."""
    if requested and requested != "auto":
        return requested
    if instance_kind == "GPU" and device_id not in (None, ""):
        return f"cuda:{int(device_id)}"
    return "auto"


def resolve_kernels(name: str, device: str) -> bool:
    """Whether LoRA and decode attention run as Triton kernels ("auto": on CUDA only)."""
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels '{name}' not supported; choose auto, triton or torch")
    return name == "triton" or (name == "auto" and device.startswith("cuda"))

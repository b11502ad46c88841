"""What the capacity benchmark needs before it measures: the checkpoint, the device's name, package versions.

The checkpoint (perf/engine/checkpoint.py: a random-weight base of a named shape and a catalogue of rank-r
adapters on all 7 projections, a few distinct adapter directories shared by many names) is written
once into the work folder and reused by later calls while the machine keeps it (a marker file says
it is complete). It is written in a child process: the parent never touches the GPU, so every
target finds the whole device free.
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CheckpointSpec:
    """A checkpoint of ``shape`` with ``adapters`` adapter names over ``distinct`` rank-``rank`` directories."""

    shape: str
    device: str  # "auto", "cpu", "cuda", "cuda:N"
    adapters: int
    rank: int = 16
    distinct: int = 8


@dataclass
class PreparedCheckpoint:
    base_dir: str
    catalogue: str
    device: str  # resolved
    device_name: str  # torch.cuda.get_device_name, or "cpu"
    dtype: str
    write_s: float  # 0 when everything was there already


def _prepare(spec: CheckpointSpec, root: str, queue) -> None:
    try:
        queue.put(("ok", asdict(prepare_checkpoint(spec, Path(root)))))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback

        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def prepare_checkpoint(spec: CheckpointSpec, root: Path) -> PreparedCheckpoint:
    """Write (or find) the checkpoint under ``root``; run in a child process (it may use the GPU).

    The base and the distinct adapter directories depend on the shape, dtype, rank and distinct count only,
    so calls with other adapter counts reuse them; the catalogue JSON (names lora-0000 .. lora-{n-1}, name i
    on directory i mod distinct) is written for the count asked for, since the server registers every name
    of its catalogue.
    """
    import torch

    from manylora.engine.devices import resolve_device
    from perf.capacity.requests import adapter_names
    from perf.engine.checkpoint import SHAPES, write_adapter_catalogue, write_base

    device = resolve_device(spec.device)
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    dtype_name = str(dtype).replace("torch.", "")
    folder = root / f"{spec.shape}-{dtype_name}"
    shape = SHAPES[spec.shape]
    build = device if cuda else "cpu"
    t, wrote = time.monotonic(), False
    base = folder / "base"
    if not (folder / "base.complete").is_file():
        wrote = True
        write_base(base, shape, dtype=dtype, device=build)
        (folder / "base.complete").write_text(json.dumps(asdict(spec)))
    adapters = folder / f"adapters-r{spec.rank}-d{spec.distinct}"
    if not (adapters / "complete").is_file():
        wrote = True
        write_adapter_catalogue(adapters, shape, adapter_names(spec.distinct), distinct=spec.distinct,
                                rank=spec.rank, dtype=dtype, device=build, base_dir=str(base))
        (adapters / "complete").write_text(json.dumps(asdict(spec)))
    written = time.monotonic() - t if wrote else 0.0
    directories = sorted(str(d) for d in adapters.glob("distinct-*"))
    catalogue = adapters / f"catalogue-n{spec.adapters}.json"
    names = adapter_names(spec.adapters)
    catalogue.write_text(json.dumps({name: directories[i % len(directories)] for i, name in enumerate(names)},
                                    indent=1))
    gpu = torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu"
    return PreparedCheckpoint(str(base), str(catalogue), device, gpu, dtype_name, round(written, 1))


def prepare_in_child(spec: CheckpointSpec, root: Path, timeout_s: float = 1800) -> PreparedCheckpoint:
    """prepare_checkpoint in a spawned process (the GPU is free again when it returns)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    proc = context.Process(target=_prepare, args=(spec, str(root), queue), daemon=True)
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout_s)
    finally:
        proc.join(timeout=60)
    if status != "ok":
        raise RuntimeError(f"writing the checkpoint failed: {payload}")
    return PreparedCheckpoint(**payload)


def package_versions(names: tuple[str, ...] = ("torch", "triton", "tritonclient", "numpy", "vllm")) -> dict[str, str]:
    """Installed versions (from package metadata, nothing imported); absent packages are left out."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

"""Read a Hugging Face checkpoint's safetensors (one file or sharded) into named tensors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from manylora.engine.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """"auto" is float32 on the CPU and bfloat16 on CUDA; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype '{name}' not supported; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or the single file."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index with a weight_map ({e})") from e
        files = sorted({root / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shards missing: {missing}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{root}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors (only safetensors checkpoints load)")


def load_state_dict(
    model_dir: str | Path, wanted: set[str], dtype: torch.dtype, device: str,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Load the tensors named in ``wanted`` (others are skipped), converted to dtype on device.

    ``transform(name, tensor)`` (if given) runs on each tensor in host memory before it moves to the
    device, one tensor at a time: a tensor-parallel rank keeps only its shard this way."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in wanted:
                        tensor = f.get_tensor(name)
                        if transform is not None:
                            tensor = transform(name, tensor)
                        tensors[name] = tensor.to(device=device, dtype=dtype)
        except (OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from e
    missing = sorted(wanted - tensors.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {shown}")
    return tensors

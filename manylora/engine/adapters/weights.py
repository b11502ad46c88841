"""Load an adapter's A/B tensors from its file: mapped, hashed again when it changed since
registration, matched against the registered spec, NaN/Inf refused, converted to the model dtype.

Registration (``manylora.engine.adapters.spec.parse_adapter_spec``) reads only the header; this is the first
use of the weights (the host tier's loaders call it, in threads or child processes).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from manylora.engine.adapters.layout import EXPERT_ENTRY_PREFIX, TORCH_DTYPE_NAMES, module_entries
from manylora.engine.adapters.spec import AdapterSpec, LoraWeights, file_stamp
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import ModelConfig
from manylora.engine.safetensors_view import data_section, parse_safetensors


def load_adapter_weights(
    spec: AdapterSpec,
    model_config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pause: Callable[[], None] | None = None,
    rehash: bool = False,
) -> LoraWeights:
    """Load an adapter's A/B tensors, checking bytes, shapes, ranks and values against ``spec``.

    ``pause`` (if given) is called before each module's tensors are checked: a loader thread
    waits there while the engine thread launches a step (manylora/engine/adapters/host_cache.py).

    The file is hashed again unless its stamp (``AdapterSpec.file_stamp``) is unchanged since
    registration, or always with ``rehash``.

    Raises :class:`AdapterError` when the file changed since registration (sha256 mismatch), a
    tensor's shape or rank disagrees with the base model or the spec, or a value is NaN/Inf.
    """
    name = spec.name
    weights_path = spec.weights_path
    try:
        data, stat = map_file(weights_path)
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"cannot read {weights_path}: {e}") from e
    unchanged = not rehash and spec.file_stamp is not None and file_stamp(stat) == spec.file_stamp
    digest = spec.sha256 if unchanged else hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise AdapterError(
            name,
            f"{weights_path} changed since registration: sha256 {digest} != registered {spec.sha256}; "
            f"re-register the adapter",
        )
    try:
        tensors = parse_safetensors(data)
    except ValueError as e:
        raise AdapterError(name, f"{weights_path} is not a valid safetensors file: {e}") from e
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, t in tensors.items():
        dt = TORCH_DTYPE_NAMES.get(t.dtype)
        header[key] = (tuple(t.shape), dt if dt is not None else str(t.dtype))
    entries = module_entries(name, header, model_config, max_lora_rank=max(spec.rank, 1))
    loaded_modules = set(entries)
    registered = set(spec.layer_ranks) | {(layer, EXPERT_ENTRY_PREFIX + p) for layer, p in spec.expert_ranks}
    if loaded_modules != registered:
        raise AdapterError(
            name, f"{weights_path} holds modules {sorted(loaded_modules)}, registered {sorted(registered)}"
        )
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    expert_weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    finite = _all_finite(data, tensors)  # one pass over the file; per tensor only to name a bad one
    for lm, entry in sorted(entries.items()):
        if pause is not None:
            pause()
        if entry.num_experts:
            key = (lm[0], lm[1][len(EXPERT_ENTRY_PREFIX):])
            if entry.rank != spec.expert_ranks[key]:
                raise AdapterError(
                    name,
                    f"tensor '{entry.a_key}' has rank {entry.rank} per expert, registered {spec.expert_ranks[key]}",
                )
            a = _checked_tensor(name, entry.a_key, tensors[entry.a_key], dtype, finite)
            b = _checked_tensor(name, entry.b_key, tensors[entry.b_key], dtype, finite)
            num_experts, rank = entry.num_experts, entry.rank
            a = a.reshape(num_experts, rank, a.shape[1])  # expert-major rows
            b = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)  # rank-major columns -> [E, out, r]
            expert_weights[key] = (a.to(device).contiguous(), b.to(device).contiguous(), spec.expert_scaling[key])
            continue
        if entry.rank != spec.layer_ranks[lm]:
            raise AdapterError(
                name, f"tensor '{entry.a_key}' has rank {entry.rank}, registered rank {spec.layer_ranks[lm]}"
            )
        a = _checked_tensor(name, entry.a_key, tensors[entry.a_key], dtype, finite)
        b = _checked_tensor(name, entry.b_key, tensors[entry.b_key], dtype, finite)
        weights[lm] = (a.to(device).contiguous(), b.to(device).contiguous(), spec.scaling[lm])
    return LoraWeights(spec=spec, weights=weights, expert_weights=expert_weights)


def map_file(path: Path) -> tuple[object, os.stat_result]:
    """The file's bytes as a copy-on-write mapping (tensors can view it; hashing reads it in place,
    without the GIL), or a bytearray for an empty file (which cannot be mapped); and its stat."""
    with open(path, "rb") as f:
        stat = os.fstat(f.fileno())
        if stat.st_size == 0:
            return bytearray(), stat
        return mmap.mmap(f.fileno(), stat.st_size, access=mmap.ACCESS_COPY), stat


def _all_finite(buf, tensors: Mapping[str, torch.Tensor]) -> bool:
    """True when every tensor is known finite from one check over the whole data section (all of one
    float dtype); False means "check each tensor"."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        return False
    flat = data_section(buf, next(iter(dtypes)))
    if flat is None:
        return False
    low, high = torch.aminmax(flat)  # NaN propagates into both; one pass, ~50x faster than isfinite on bf16
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _checked_tensor(name: str, key: str, t: torch.Tensor, dtype: torch.dtype, known_finite: bool = False
                    ) -> torch.Tensor:
    """Convert to ``dtype`` and refuse NaN/Inf (in the file, or from overflow in the conversion)."""
    if not known_finite and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise AdapterError(name, f"tensor '{key}' has {bad} non-finite (NaN/Inf) values")
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if not bool(torch.isfinite(out).all()):
        raise AdapterError(name, f"tensor '{key}' overflows {dtype} (values up to {float(t.abs().max()):.3g})")
    return out

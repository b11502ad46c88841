"""One PEFT LoRA adapter directory against the base model: its spec, parsed and validated.

Registration (:func:`parse_adapter_spec`) reads only ``adapter_config.json``, the safetensors
header and the file's sha256, so that thousands of adapters can be registered at startup.
Loading (``manylora/engine/adapters/weights.py``) reads the tensors, checks that the bytes are the ones
that were registered, and checks every shape and value; both match the file's tensors to the base's modules
with ``manylora/engine/adapters/layout.py``.

PEFT (0.21) saves keys like ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``); MLP projections sit under ``.mlp.``. Keys
with an adapter-name segment (``lora_A.default.weight``) are accepted too.

MoE bases (Mixtral, Qwen3-MoE): LoRA on the experts is PEFT's ``target_parameters`` on transformers 5's
fused expert parameters (PEFT's ParamWrapper). Its keys are ``layers.{i}.mlp.experts[.base_layer].lora_A.weight``
(``[r * E, in]``, expert-major: rows ``e * r .. e * r + r - 1`` are expert e's A) and ``...lora_B.weight``
(``[out, r * E]``, rank-major: column ``k * E + e`` is column k of expert e's B); the inner wrapper
(``.base_layer``) and the outer one each adapt one of ``gate_up_proj`` (in = hidden, out = 2 * moe_intermediate)
and ``down_proj`` (in = moe_intermediate, out = hidden), told apart by shape. Expert e's weight becomes
``W_e + scaling * B_e @ A_e``. The per-expert layout of transformers 4 (``experts.{e}.w1.lora_A``) and LoRA on
the router (``mlp.gate``) are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from manylora.engine.adapters.config import (
    AdapterConfig,
    check_target_parameters,
    pattern_value,
    read_adapter_config,
)
from manylora.engine.adapters.layout import EXPERT_ENTRY_PREFIX, ModuleEntry, module_entries, read_safetensors_header
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import PROJECTIONS, ModelConfig

WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"

_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class AdapterSpec:
    """What registration learned about one adapter (metadata only, no weights).

    Attributes:
        name: the name requests use to select the adapter.
        path: the adapter directory.
        sha256: hex digest of ``adapter_model.safetensors``.
        rank: the largest rank over all adapted modules.
        ranks: projection name -> largest rank of that projection over the layers.
        target_modules: sorted projection names that have weights.
        layers: sorted layer indices that have weights.
        scaling: (layer, projection) -> lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).
        layer_ranks: (layer, projection) -> rank of that module (rank_pattern can vary it).
        base_model_name_or_path: as recorded in adapter_config.json, if any.
        use_rslora: whether the scaling is rank-stabilised.
        num_bytes: size of ``adapter_model.safetensors``.
        expert_ranks: (layer, expert parameter) -> rank per expert (MoE bases; "gate_up_proj" or "down_proj").
        expert_scaling: (layer, expert parameter) -> lora_alpha / r of that expert parameter.
        file_stamp: (device, inode, size, mtime_ns, ctime_ns) of the weights file when it was hashed,
            if it was unchanged during hashing and older than STAMP_MIN_AGE_S; a load finding the same
            stamp skips re-hashing (any write to a file changes its ctime). None: always re-hash.
    """

    name: str
    path: str
    sha256: str
    rank: int
    ranks: dict[str, int] = field(hash=False)
    target_modules: tuple[str, ...]
    layers: tuple[int, ...]
    scaling: dict[tuple[int, str], float] = field(hash=False)
    layer_ranks: dict[tuple[int, str], int] = field(hash=False)
    base_model_name_or_path: str | None = None
    use_rslora: bool = False
    num_bytes: int = 0
    expert_ranks: dict[tuple[int, str], int] = field(default_factory=dict, hash=False)
    expert_scaling: dict[tuple[int, str], float] = field(default_factory=dict, hash=False)
    file_stamp: tuple[int, ...] | None = field(default=None, hash=False, compare=False)

    @property
    def weights_path(self) -> Path:
        """Path of the adapter's safetensors file."""
        return Path(self.path) / WEIGHTS_FILE


def lora_num_parameters(spec: AdapterSpec, model_config: ModelConfig) -> int:
    """Elements in all of the adapter's A and B matrices."""
    total = 0
    for (_, module), r in spec.layer_ranks.items():
        n_in, n_out = model_config.projection_shape(module)
        total += r * (n_in + n_out)
    for (_, parameter), r in spec.expert_ranks.items():
        n_in, n_out = model_config.expert_shape(parameter)
        total += r * model_config.num_experts * (n_in + n_out)
    return total


@dataclass
class LoraWeights:
    """An adapter's tensors: (layer, projection) -> (A [r, in], B [out, r], scaling)."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    # MoE bases: (layer, expert parameter) -> (A [E, r, in], B [E, out, r], scaling), expert e's factors at [e].
    expert_weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes held by the A and B tensors."""
        tensors = [*self.weights.values(), *self.expert_weights.values()]
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in tensors)


# --------------------------------------------------------------------------------------------------------------------
# public helpers


def compute_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def parse_adapter_spec(name: str, path: str | Path, model_config: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Validate an adapter directory against the base model from its config and safetensors header.

    Reads ``adapter_config.json``, the safetensors header (no tensor data) and hashes the file.
    Raises :class:`AdapterError` naming the adapter and the reason when it cannot be served.
    """
    adapter_dir = Path(path)
    if not adapter_dir.exists():
        raise AdapterError(name, f"directory {adapter_dir} does not exist")
    if not adapter_dir.is_dir():
        raise AdapterError(name, f"{adapter_dir} is not a directory (expected a PEFT adapter directory)")
    cfg = read_adapter_config(name, adapter_dir)
    check_target_parameters(name, cfg.target_parameters, model_config)
    weights_path = adapter_dir / WEIGHTS_FILE
    if not weights_path.is_file():
        if (adapter_dir / LEGACY_WEIGHTS_FILE).exists():
            raise AdapterError(
                name,
                f"{adapter_dir} has only {LEGACY_WEIGHTS_FILE}; only safetensors adapters are supported "
                f"(pickle files can run code): re-save it with save_pretrained(..., safe_serialization=True)",
            )
        raise AdapterError(name, f"{weights_path} not found")
    try:
        before = weights_path.stat()
        sha256 = compute_sha256(weights_path)
        after = weights_path.stat()
    except OSError as e:
        raise AdapterError(name, f"cannot read {weights_path}: {e}") from e
    stamp = file_stamp(after)
    settled = time.time_ns() - after.st_ctime_ns > STAMP_MIN_AGE_S * 1e9  # timestamps have coarse ticks
    header = read_safetensors_header(name, weights_path)
    entries = module_entries(name, header, model_config, max_lora_rank)
    spec = _build_spec(name, adapter_dir, sha256, after.st_size, cfg, entries, model_config)
    if file_stamp(before) == stamp and settled:
        spec = dataclasses.replace(spec, file_stamp=stamp)
    return spec


STAMP_MIN_AGE_S = 2.0  # a file changed this recently is always re-hashed at load


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What changes whenever a file's bytes do (the kernel updates ctime on every write)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _build_spec(
    name: str,
    adapter_dir: Path,
    sha256: str,
    num_bytes: int,
    cfg: AdapterConfig,
    entries: dict[tuple[int, str], ModuleEntry],
    model_config: ModelConfig,
) -> AdapterSpec:
    """Combine config and layout: check declared ranks and layers, compute the scaling per module."""
    layers = tuple(sorted({layer for layer, _ in entries}))
    if cfg.layers_to_transform is not None:
        too_deep = [i for i in cfg.layers_to_transform if i >= model_config.num_layers]
        if too_deep:
            raise AdapterError(
                name,
                f"layers_to_transform lists layers {too_deep} >= the base model's num_layers {model_config.num_layers}",
            )
        extra = sorted(set(layers) - set(cfg.layers_to_transform))
        missing = sorted(set(cfg.layers_to_transform) - set(layers))
        if extra or missing:
            raise AdapterError(
                name,
                f"weights do not match layers_to_transform {list(cfg.layers_to_transform)}: weights in layers "
                f"{list(layers)}"
                + (f"; unlisted {extra}" if extra else "")
                + (f"; no weights for {missing}" if missing else ""),
            )
    layer_ranks: dict[tuple[int, str], int] = {}
    scaling: dict[tuple[int, str], float] = {}
    ranks: dict[str, int] = {}
    expert_ranks: dict[tuple[int, str], int] = {}
    expert_scaling: dict[tuple[int, str], float] = {}
    for lm, entry in entries.items():
        declared = pattern_value(cfg.rank_pattern, entry.module_key, cfg.r)
        if declared != entry.rank:
            raise AdapterError(
                name,
                f"tensor '{entry.a_key}' has rank {entry.rank} but adapter_config.json declares r={declared} for "
                f"'{entry.module_key}' (r={cfg.r}, rank_pattern {dict(cfg.rank_pattern)}); cannot interpret the "
                f"rank_pattern, refusing rather than guessing the scaling",
            )
        alpha = pattern_value(cfg.alpha_pattern, entry.module_key, cfg.lora_alpha)
        if entry.num_experts:
            key = (lm[0], lm[1][len(EXPERT_ENTRY_PREFIX):])
            expert_scaling[key] = alpha / math.sqrt(entry.rank) if cfg.use_rslora else alpha / entry.rank
            expert_ranks[key] = entry.rank
            continue
        scaling[lm] = alpha / math.sqrt(entry.rank) if cfg.use_rslora else alpha / entry.rank
        layer_ranks[lm] = entry.rank
        ranks[lm[1]] = max(ranks.get(lm[1], 0), entry.rank)
    expert_targets = sorted({EXPERT_ENTRY_PREFIX + p for _, p in expert_ranks})
    return AdapterSpec(
        name=name,
        path=str(adapter_dir),
        sha256=sha256,
        rank=max([*ranks.values(), *expert_ranks.values()]),
        ranks=dict(sorted(ranks.items(), key=lambda kv: PROJECTIONS.index(kv[0]))),
        target_modules=tuple(sorted(ranks)) + tuple(expert_targets),
        layers=layers,
        scaling=dict(sorted(scaling.items())),
        layer_ranks=dict(sorted(layer_ranks.items())),
        base_model_name_or_path=cfg.base_model_name_or_path,
        use_rslora=cfg.use_rslora,
        num_bytes=num_bytes,
        expert_ranks=dict(sorted(expert_ranks.items())),
        expert_scaling=dict(sorted(expert_scaling.items())),
    )

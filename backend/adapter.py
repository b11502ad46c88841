"""One PEFT LoRA adapter directory against the base model: its spec, parsed and validated.

Registration (:func:`parse_adapter_spec`) reads only ``adapter_config.json``, the safetensors
header and the file's sha256, so that thousands of adapters can be registered at startup.
Loading (``backend/adapter_weights.py``) reads the tensors, checks that the bytes are the ones
that were registered, and checks every shape and value, with this module's key layout.

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
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.adapter_config import (
    AdapterConfig,
    check_target_parameters,
    pattern_value,
    read_adapter_config,
)
from backend.errors import AdapterError
from backend.model_config import (
    ATTENTION_PROJECTIONS,
    EXPERT_PARAMETERS,
    MLP_PROJECTIONS,
    PROJECTIONS,
    ModelConfig,
)

WEIGHTS_FILE = "adapter_model.safetensors"
LEGACY_WEIGHTS_FILE = "adapter_model.bin"

_HASH_CHUNK = 1 << 20
# safetensors dtype names we accept for LoRA factors.
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
TORCH_DTYPE_NAMES = {v: k for k, v in _FLOAT_DTYPES.items()}

# [base_model.model.][model.]layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}[.{adapter_name}].weight
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module_key>(?:model\.)?layers\.(?P<layer>[0-9]{1,9})\.(?P<block>self_attn|mlp)"
    r"\.(?P<proj>[A-Za-z0-9_]+))\.(?P<ab>lora_A|lora_B)(?:\.(?P<adapter_name>[^.]+))?\.weight$"
)
# PEFT target_parameters on fused MoE experts: [base_model.model.][model.]layers.{i}.mlp.experts[.base_layer]*.lora_X
_EXPERT_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module_key>(?:model\.)?layers\.(?P<layer>[0-9]{1,9})\.mlp\.experts)"
    r"(?P<nest>(?:\.base_layer)*)\.(?P<ab>lora_A|lora_B)(?:\.(?P<adapter_name>[^.]+))?\.weight$"
)
# One module per expert (transformers 4 layout): ...experts.{e}.{w1|gate_proj|...}.lora_X
_PER_EXPERT_KEY_RE = re.compile(r"\.experts\.[0-9]+\.[^.]+\.lora_(?:A|B)\.")
# Prefix of the entry names of expert parameters in _layout's result: (layer, "experts.gate_up_proj").
EXPERT_ENTRY_PREFIX = "experts."
# Used only to name the offending module in an error: the segment before ".lora_".
_MODULE_OF_KEY_RE = re.compile(r"(?:^|\.)(?P<module>[^.]+)\.lora_")

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


@dataclass(frozen=True)
class _ModuleEntry:
    """The A/B tensor keys of one adapted module in the safetensors file."""

    module_key: str
    a_key: str
    b_key: str
    rank: int
    num_experts: int = 0  # > 0: a fused expert parameter; rank is per expert


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
    header = _read_safetensors_header(name, weights_path)
    entries = module_entries(name, header, model_config, max_lora_rank)
    spec = _build_spec(name, adapter_dir, sha256, after.st_size, cfg, entries, model_config)
    if file_stamp(before) == stamp and settled:
        spec = dataclasses.replace(spec, file_stamp=stamp)
    return spec


STAMP_MIN_AGE_S = 2.0  # a file changed this recently is always re-hashed at load


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What changes whenever a file's bytes do (the kernel updates ctime on every write)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# --------------------------------------------------------------------------------------------------------------------
# safetensors header and layout


def _read_safetensors_header(name: str, weights_path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, safetensors dtype name), read with safe_open (header only, tensor data untouched)."""
    from safetensors import safe_open

    header: dict[str, tuple[tuple[int, ...], str]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            keys = f.keys()
            for key in keys:
                sl = f.get_slice(key)
                header[key] = (tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype()))
    except Exception as e:  # SafetensorError, OSError, and others for malformed headers
        raise AdapterError(name, f"{weights_path} is not a valid safetensors file: {e}") from e
    return header


def module_entries(
    name: str,
    header: Mapping[str, tuple[tuple[int, ...], str]],
    model_config: ModelConfig,
    max_lora_rank: int,
) -> dict[tuple[int, str], _ModuleEntry]:
    """Match A/B pairs to (layer, projection) and check dtypes, shapes and ranks against the base."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    module_keys: dict[tuple[int, str], str] = {}
    expert_halves: dict[tuple[int, str], dict[str, str]] = {}  # (layer, nesting) -> lora_A/lora_B -> key
    for key in sorted(header):
        em = _EXPERT_KEY_RE.match(key)
        if em is not None:
            _collect_expert_half(name, key, em, header, model_config, expert_halves, module_keys)
            continue
        m = _KEY_RE.match(key)
        if m is None and _PER_EXPERT_KEY_RE.search(key):
            raise AdapterError(
                name,
                f"tensor '{key}': one LoRA module per expert (the transformers 4 layout) is not supported; "
                f"LoRA on experts must target transformers 5's fused expert parameters (PEFT target_parameters "
                f"experts.gate_up_proj / experts.down_proj, keys '...mlp.experts.lora_A.weight')",
            )
        if m is None:
            mod = _MODULE_OF_KEY_RE.search(key)
            what = f"module '{mod.group('module')}'" if mod else "it"
            raise AdapterError(
                name,
                f"tensor '{key}' is not a LoRA weight of a decoder projection ({what} is not supported; "
                f"LoRA may target only {', '.join(PROJECTIONS)})",
            )
        proj, block = m.group("proj"), m.group("block")
        expected_block = "self_attn" if proj in ATTENTION_PROJECTIONS else "mlp" if proj in MLP_PROJECTIONS else None
        if expected_block is None:
            raise AdapterError(
                name, f"tensor '{key}': module '{proj}' is not supported; LoRA may target only {', '.join(PROJECTIONS)}"
            )
        if block != expected_block:
            raise AdapterError(name, f"tensor '{key}': {proj} belongs under '.{expected_block}.', not '.{block}.'")
        layer = int(m.group("layer"))
        if proj in MLP_PROJECTIONS and model_config.is_sparse_layer(layer):
            raise AdapterError(
                name, f"tensor '{key}': layer {layer} of the base model is a sparse MoE layer with no dense {proj}"
            )
        if layer >= model_config.num_layers:
            raise AdapterError(
                name, f"tensor '{key}': layer index {layer} >= the base model's num_layers {model_config.num_layers}"
            )
        shape, dtype = header[key]
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(name, f"tensor '{key}' has dtype {dtype}; supported: {', '.join(_FLOAT_DTYPES)}")
        if len(shape) != 2:
            raise AdapterError(name, f"tensor '{key}' has shape {list(shape)}; expected a 2-D matrix")
        lm = (layer, proj)
        ab = m.group("ab")
        slot = halves.setdefault(lm, {})
        if ab in slot:
            raise AdapterError(name, f"tensors '{slot[ab]}' and '{key}' are both {ab} of layer {layer} {proj}")
        slot[ab] = key
        module_keys[lm] = m.group("module_key")
    if not halves and not expert_halves:
        raise AdapterError(name, "no LoRA weights (no '...lora_A.weight'/'...lora_B.weight' tensors) in the file")

    entries: dict[tuple[int, str], _ModuleEntry] = {}
    for lm, slot in sorted(halves.items()):
        layer, proj = lm
        if "lora_A" not in slot or "lora_B" not in slot:
            have, missing = ("lora_A", "lora_B") if "lora_A" in slot else ("lora_B", "lora_A")
            raise AdapterError(name, f"tensor '{slot[have]}' has no matching {missing} (layer {layer} {proj})")
        a_key, b_key = slot["lora_A"], slot["lora_B"]
        (a_rows, a_cols), (b_rows, b_cols) = header[a_key][0], header[b_key][0]
        n_in, n_out = model_config.projection_shape(proj)
        rank = a_rows
        if rank < 1:
            raise AdapterError(name, f"tensor '{a_key}' has rank 0 (shape {[a_rows, a_cols]})")
        if a_cols != n_in:
            raise AdapterError(
                name,
                f"tensor '{a_key}' has shape {[a_rows, a_cols]}, expected [r, {n_in}] for the base model's {proj} "
                f"(in_features {n_in}); is the adapter for another base model?",
            )
        if b_rows != n_out or b_cols != rank:
            raise AdapterError(
                name,
                f"tensor '{b_key}' has shape {[b_rows, b_cols]}, expected {[n_out, rank]} for the base model's {proj} "
                f"(out_features {n_out}, rank {rank} from lora_A); is the adapter for another base model?",
            )
        if rank > max_lora_rank:
            raise AdapterError(name, f"rank {rank} exceeds max_lora_rank {max_lora_rank} (tensor '{a_key}')")
        entries[lm] = _ModuleEntry(module_key=module_keys[lm], a_key=a_key, b_key=b_key, rank=rank)
    entries.update(_expert_entries(name, header, model_config, max_lora_rank, expert_halves, module_keys))
    return entries


def _collect_expert_half(name: str, key: str, m: re.Match, header: Mapping[str, tuple[tuple[int, ...], str]],
                         model_config: ModelConfig, expert_halves: dict[tuple[int, str], dict[str, str]],
                         module_keys: dict[tuple[int, str], str]) -> None:
    layer = int(m.group("layer"))
    if not model_config.is_moe:
        raise AdapterError(name, f"tensor '{key}': LoRA on MoE experts, but the base model has no experts")
    if layer >= model_config.num_layers:
        raise AdapterError(
            name, f"tensor '{key}': layer index {layer} >= the base model's num_layers {model_config.num_layers}"
        )
    if not model_config.is_sparse_layer(layer):
        raise AdapterError(name, f"tensor '{key}': layer {layer} of the base model is dense (it has no experts)")
    nest = m.group("nest")
    if nest.count(".base_layer") > 1:
        raise AdapterError(name, f"tensor '{key}': more than two nested expert-parameter wrappers")
    shape, dtype = header[key]
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(name, f"tensor '{key}' has dtype {dtype}; supported: {', '.join(_FLOAT_DTYPES)}")
    if len(shape) != 2:
        raise AdapterError(name, f"tensor '{key}' has shape {list(shape)}; expected a 2-D matrix")
    slot = expert_halves.setdefault((layer, nest), {})
    ab = m.group("ab")
    if ab in slot:
        raise AdapterError(name, f"tensors '{slot[ab]}' and '{key}' are both {ab} of layer {layer} experts{nest}")
    slot[ab] = key
    module_keys[(layer, "experts" + nest)] = m.group("module_key")


def _expert_entries(name: str, header: Mapping[str, tuple[tuple[int, ...], str]], model_config: ModelConfig,
                    max_lora_rank: int, expert_halves: dict[tuple[int, str], dict[str, str]],
                    module_keys: dict[tuple[int, str], str]) -> dict[tuple[int, str], _ModuleEntry]:
    """Pair the expert A/B tensors and tell gate_up_proj from down_proj by their shapes."""
    num_experts = model_config.num_experts
    shapes = {p: model_config.expert_shape(p) for p in EXPERT_PARAMETERS}
    entries: dict[tuple[int, str], _ModuleEntry] = {}
    for (layer, nest), slot in sorted(expert_halves.items()):
        if "lora_A" not in slot or "lora_B" not in slot:
            have, missing = ("lora_A", "lora_B") if "lora_A" in slot else ("lora_B", "lora_A")
            raise AdapterError(name, f"tensor '{slot[have]}' has no matching {missing} (layer {layer} experts)")
        a_key, b_key = slot["lora_A"], slot["lora_B"]
        (a_rows, a_cols), (b_rows, b_cols) = header[a_key][0], header[b_key][0]
        matches = [p for p, (n_in, n_out) in shapes.items() if a_cols == n_in and b_rows == n_out]
        if len(matches) != 1:
            expected = "; ".join(
                f"{p}: [r*{num_experts}, {i}] and [{o}, r*{num_experts}]" for p, (i, o) in shapes.items()
            )
            raise AdapterError(
                name,
                f"tensors '{a_key}' {[a_rows, a_cols]} and '{b_key}' {[b_rows, b_cols]} fit no expert parameter of "
                f"the base model ({expected}); is the adapter for another base model?",
            )
        parameter = matches[0]
        if a_rows < num_experts or a_rows % num_experts or b_cols != a_rows:
            raise AdapterError(
                name,
                f"tensors '{a_key}' {[a_rows, a_cols]} and '{b_key}' {[b_rows, b_cols]}: expected r * {num_experts} "
                f"(num_experts) rank rows in both",
            )
        rank = a_rows // num_experts
        if rank > max_lora_rank:
            raise AdapterError(name, f"rank {rank} exceeds max_lora_rank {max_lora_rank} (tensor '{a_key}')")
        lm = (layer, EXPERT_ENTRY_PREFIX + parameter)
        if lm in entries:
            raise AdapterError(name, f"two LoRA tensor pairs adapt layer {layer} experts.{parameter} ('{a_key}')")
        module_key = f"{module_keys[(layer, 'experts' + nest)]}.{parameter}"  # PEFT's key for rank/alpha patterns
        entries[lm] = _ModuleEntry(module_key=module_key, a_key=a_key, b_key=b_key, rank=rank,
                                   num_experts=num_experts)
    return entries


def _build_spec(
    name: str,
    adapter_dir: Path,
    sha256: str,
    num_bytes: int,
    cfg: AdapterConfig,
    entries: dict[tuple[int, str], _ModuleEntry],
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

"""Which tensors of a PEFT adapter's safetensors file adapt which module of the base: keys, shapes, dtypes, ranks.

Read from the file's header only (``module_entries``), at registration and again at loading, so that both name
the same tensors. The key layouts are described in ``manylora/engine/adapters/spec.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from manylora.engine.errors import AdapterError
from manylora.engine.model_config import (
    ATTENTION_PROJECTIONS,
    EXPERT_PARAMETERS,
    MLP_PROJECTIONS,
    PROJECTIONS,
    ModelConfig,
)

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
class ModuleEntry:
    """The A/B tensor keys of one adapted module in the safetensors file."""

    module_key: str
    a_key: str
    b_key: str
    rank: int
    num_experts: int = 0  # > 0: a fused expert parameter; rank is per expert


def read_safetensors_header(name: str, weights_path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
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
) -> dict[tuple[int, str], ModuleEntry]:
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

    entries: dict[tuple[int, str], ModuleEntry] = {}
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
        entries[lm] = ModuleEntry(module_key=module_keys[lm], a_key=a_key, b_key=b_key, rank=rank)
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
                    module_keys: dict[tuple[int, str], str]) -> dict[tuple[int, str], ModuleEntry]:
    """Pair the expert A/B tensors and tell gate_up_proj from down_proj by their shapes."""
    num_experts = model_config.num_experts
    shapes = {p: model_config.expert_shape(p) for p in EXPERT_PARAMETERS}
    entries: dict[tuple[int, str], ModuleEntry] = {}
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
        entries[lm] = ModuleEntry(module_key=module_key, a_key=a_key, b_key=b_key, rank=rank,
                                   num_experts=num_experts)
    return entries

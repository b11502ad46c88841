"""adapter_config.json: read it, check it, and refuse what this server does not implement."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manylora.engine.errors import AdapterError
from manylora.engine.model_config import EXPERT_PARAMETERS, PROJECTIONS, ModelConfig

CONFIG_FILE = "adapter_config.json"

# Config fields that change what the adapter computes and that this server does not implement;
# a config that sets one of them (to anything but null/false/empty) is refused.
_UNSUPPORTED_FIELDS: tuple[str, ...] = (
    "lora_bias",
    "trainable_token_indices",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of adapter_config.json that decide the weights' meaning."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]
    layers_to_transform: tuple[int, ...] | None
    base_model_name_or_path: str | None
    target_parameters: object = None  # as written in adapter_config.json; checked against the base model


def read_adapter_config(name: str, adapter_dir: Path) -> AdapterConfig:
    """Read and check adapter_config.json; refuse features this server does not implement."""
    cfg_path = adapter_dir / CONFIG_FILE
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise AdapterError(name, f"{cfg_path} not found; a PEFT adapter directory needs {CONFIG_FILE}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(name, f"{cfg_path} is not valid JSON ({e})") from e
    except OSError as e:
        raise AdapterError(name, f"cannot read {cfg_path}: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(name, f"{cfg_path} must hold a JSON object, got {type(raw).__name__}")

    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    if raw.get("use_dora"):
        raise AdapterError(name, "use_dora is true: DoRA is not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(
            name,
            f"modules_to_save {raw['modules_to_save']!r} is not supported: the adapter replaces whole base "
            f"modules, which cannot be shared between adapters",
        )
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterError(name, f"bias is {bias!r}; only 'none' is supported (the adapter would change base biases)")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(name, "fan_in_fan_out is true (Conv1D/GPT-2 layout); only nn.Linear layout is supported")
    for key in _UNSUPPORTED_FIELDS:
        if raw.get(key):
            raise AdapterError(name, f"{key}={raw[key]!r} is not supported")

    _check_target_modules(name, raw.get("target_modules"))

    r = raw.get("r", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(name, f"r must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise AdapterError(name, f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(name, f"use_rslora must be true or false, got {use_rslora!r}")

    rank_pattern = _read_pattern(name, "rank_pattern", raw.get("rank_pattern"), integer=True)
    alpha_pattern = _read_pattern(name, "alpha_pattern", raw.get("alpha_pattern"), integer=False)

    ltt = raw.get("layers_to_transform")
    layers_to_transform: tuple[int, ...] | None
    if ltt is None or ltt == []:
        layers_to_transform = None
    elif _is_int(ltt):
        layers_to_transform = (int(ltt),)
    elif isinstance(ltt, list) and all(_is_int(x) and x >= 0 for x in ltt):
        layers_to_transform = tuple(sorted(set(ltt)))
    else:
        raise AdapterError(name, f"layers_to_transform must be an int or a list of ints, got {ltt!r}")

    target_parameters = raw.get("target_parameters")
    if target_parameters and (
        not isinstance(target_parameters, list) or not all(isinstance(t, str) for t in target_parameters)
    ):
        raise AdapterError(name, f"target_parameters must be a list of names, got {target_parameters!r}")

    base = raw.get("base_model_name_or_path")
    return AdapterConfig(
        r=int(r),
        lora_alpha=float(alpha),
        use_rslora=use_rslora,
        rank_pattern=tuple((k, int(v)) for k, v in rank_pattern),
        alpha_pattern=tuple((k, float(v)) for k, v in alpha_pattern),
        layers_to_transform=layers_to_transform,
        base_model_name_or_path=base if isinstance(base, str) else None,
        target_parameters=target_parameters or None,
    )


def check_target_parameters(name: str, targets: object, model_config: ModelConfig) -> None:
    """PEFT target_parameters: only the fused expert parameters of an MoE base."""
    if not targets:
        return
    if not model_config.is_moe:
        raise AdapterError(name, f"target_parameters={targets!r} is not supported")
    for t in targets:
        container, _, leaf = t.rpartition(".")
        if leaf not in EXPERT_PARAMETERS or (container and not (container + ".").endswith("experts.")):
            raise AdapterError(
                name,
                f"target_parameters entry '{t}' is not supported; on an MoE base LoRA may target only the expert "
                f"parameters {', '.join('experts.' + p for p in EXPERT_PARAMETERS)} (not the router or others)",
            )


def _check_target_modules(name: str, targets: object) -> None:
    """Refuse targets outside the 7 decoder projections; a regex string is left to the weight check."""
    if targets is None or isinstance(targets, str):
        return  # "all-linear" or a regex: the weights present decide (checked in _layout)
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(name, f"target_modules must be a list of names or a string, got {targets!r}")
    for t in targets:
        leaf = t.rsplit(".", 1)[-1]
        if leaf not in PROJECTIONS:
            raise AdapterError(
                name, f"target module '{t}' is not supported; LoRA may target only {', '.join(PROJECTIONS)}"
            )


def _read_pattern(name: str, field_name: str, value: object, *, integer: bool) -> list[tuple[str, float]]:
    """Read a rank_pattern/alpha_pattern dict, keeping its order (PEFT takes the first matching key)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise AdapterError(name, f"{field_name} must be an object, got {type(value).__name__}")
    out: list[tuple[str, float]] = []
    for key, v in value.items():
        ok = (_is_int(v) and v >= 1) if integer else _is_number(v)
        if not ok:
            kind = "a positive integer" if integer else "a number"
            raise AdapterError(name, f"{field_name}[{key!r}] must be {kind}, got {v!r}")
        try:
            re.compile(rf"(.*\.)?({key})$")
        except re.error as e:
            raise AdapterError(
                name, f"{field_name} key {key!r} cannot be interpreted as a PEFT module pattern ({e})"
            ) from e
        out.append((key, v))
    return out


def pattern_value(patterns: tuple[tuple[str, Any], ...], module_key: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first key K with re.match(rf"(.*\\.)?(K)$", module_key) wins."""
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)

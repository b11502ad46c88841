"""Tiny Llama bases and real PEFT adapters saved from them (random weights), and edits of a saved adapter: shared by
the adapter tests (tests/test_adapter.py, tests/test_adapter_refusals.py)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from manylora.engine.model_config import PROJECTIONS, ModelConfig

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
MAX_RANK = 16


def base_config(**overrides: int) -> LlamaConfig:
    """A tiny Llama config."""
    return LlamaConfig(**{**TINY, **overrides})


def model_config(**overrides: int) -> ModelConfig:
    """ModelConfig of the tiny Llama base (with overrides)."""
    d = base_config(**overrides).to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    return ModelConfig.from_dict(d)


def make_adapter(path: Path, *, seed: int = 0, base: dict | None = None, **lora_kwargs: object) -> PeftModel:
    """Save a PEFT LoRA adapter with random (nonzero) A and B to ``path``; return the PeftModel."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(base_config(**(base or {})))
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": list(PROJECTIONS), **lora_kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(model, LoraConfig(**kwargs))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_()
        pm.save_pretrained(str(path))
    return pm


def peft_modules(pm: PeftModel) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, projection) -> the PEFT LoRA layer wrapping that projection."""
    out = {}
    for n, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = n.split(".")
            out[(int(parts[parts.index("layers") + 1]), parts[-1])] = mod
    return out


def copy_of(golden: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "adapter"
    shutil.copytree(golden, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    f = path / "adapter_model.safetensors"
    save_file(fn(load_file(str(f))), str(f), metadata={"format": "pt"})

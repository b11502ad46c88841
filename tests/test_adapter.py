"""manylora.engine.adapters.spec against real PEFT adapters (peft get_peft_model + save_pretrained, random weights):
what PEFT
writes, and parsing and loading agreeing with it."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from peft_adapters import (
    MAX_RANK,
    copy_of,
    edit_config,
    edit_weights,
    make_adapter,
    model_config,
    peft_modules,
)
from safetensors.torch import load_file

from manylora.engine.adapters.spec import (
    AdapterSpec,
    LoraWeights,
    compute_sha256,
    parse_adapter_spec,
)
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def mc() -> ModelConfig:
    return model_config()


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One valid adapter (r=4, all projections, all layers); copy it before changing it."""
    path = tmp_path_factory.mktemp("golden")
    make_adapter(path)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# what PEFT writes, and parse/load agreeing with it


def test_peft_0_21_key_format(golden: Path) -> None:
    keys = set(load_file(str(golden / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 3 * 7 * 2
    assert not (golden / "adapter_model.bin").exists()


CASES: dict[str, dict] = {
    "all_r4": {},
    "qv_r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp_r2_rslora": {
        "r": 2,
        "lora_alpha": 5,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "use_rslora": True,
    },
    "layers_to_transform": {"r": 3, "target_modules": ["k_proj", "o_proj"], "layers_to_transform": [0, 2]},
    "rank_pattern": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
        "alpha_pattern": {"v_proj": 3, "layers.2.mlp.down_proj": 12},
        "use_rslora": True,
    },
    "all_linear": {"r": 5, "target_modules": "all-linear"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parse_and_load_match_peft(case: str, tmp_path: Path, mc: ModelConfig) -> None:
    pm = make_adapter(tmp_path, seed=len(case), **CASES[case])
    spec = parse_adapter_spec(f"ad-{case}", tmp_path, mc, MAX_RANK)
    mods = peft_modules(pm)

    assert isinstance(spec, AdapterSpec)
    assert spec.name == f"ad-{case}"
    assert spec.sha256 == hashlib.sha256((tmp_path / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert spec.target_modules == tuple(sorted({m for _, m in mods}))
    assert spec.layers == tuple(sorted({layer for layer, _ in mods}))
    assert set(spec.layer_ranks) == set(mods) == set(spec.scaling)
    for key, mod in mods.items():
        assert spec.layer_ranks[key] == mod.r["default"]
        assert spec.scaling[key] == pytest.approx(mod.scaling["default"], rel=1e-12)
    assert spec.rank == max(m.r["default"] for m in mods.values())
    for module in spec.target_modules:
        assert spec.ranks[module] == max(m.r["default"] for (_, p), m in mods.items() if p == module)

    lw = load_adapter_weights(spec, mc)
    assert isinstance(lw, LoraWeights) and lw.spec is spec
    assert set(lw.weights) == set(mods)
    for key, (a, b, scaling) in lw.weights.items():
        n_in, n_out = mc.projection_shape(key[1])
        assert a.shape == (spec.layer_ranks[key], n_in) and b.shape == (n_out, spec.layer_ranks[key])
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, mods[key].lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(b, mods[key].lora_B["default"].weight, rtol=0, atol=0)
        assert scaling == spec.scaling[key]


def test_rank_pattern_and_rslora_scaling_values(tmp_path: Path, mc: ModelConfig) -> None:
    make_adapter(tmp_path, **CASES["rank_pattern"])
    spec = parse_adapter_spec("rp", tmp_path, mc, MAX_RANK)
    assert spec.layer_ranks[(1, "q_proj")] == 2 and spec.layer_ranks[(0, "q_proj")] == 4
    assert spec.ranks == {"q_proj": 4, "v_proj": 4, "down_proj": 6}
    assert spec.scaling[(0, "q_proj")] == pytest.approx(8 / math.sqrt(4))
    assert spec.scaling[(1, "q_proj")] == pytest.approx(8 / math.sqrt(2))
    assert spec.scaling[(0, "v_proj")] == pytest.approx(3 / math.sqrt(4))
    assert spec.scaling[(2, "down_proj")] == pytest.approx(12 / math.sqrt(6))
    assert spec.scaling[(0, "down_proj")] == pytest.approx(8 / math.sqrt(6))


def test_plain_scaling_is_alpha_over_r(tmp_path: Path, mc: ModelConfig) -> None:
    make_adapter(tmp_path, r=8, lora_alpha=32, target_modules=["q_proj"])
    spec = parse_adapter_spec("plain", tmp_path, mc, MAX_RANK)
    assert set(spec.scaling.values()) == {4.0}
    assert spec.use_rslora is False


def test_adapter_name_segment_in_keys_is_accepted(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    edit_weights(path, lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    spec = parse_adapter_spec("seg", path, mc, MAX_RANK)
    ref = load_adapter_weights(parse_adapter_spec("ref", golden, mc, MAX_RANK), mc)
    got = load_adapter_weights(spec, mc)
    for key, (a, b, _) in ref.weights.items():
        assert torch.equal(got.weights[key][0], a) and torch.equal(got.weights[key][1], b)


def test_load_dtype_and_bf16_file(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    edit_weights(path, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    spec = parse_adapter_spec("bf", path, mc, MAX_RANK)
    lw = load_adapter_weights(spec, mc, dtype=torch.float16, device="cpu")
    a, b, _ = lw.weights[(0, "q_proj")]
    assert a.dtype == b.dtype == torch.float16 and a.device.type == "cpu"
    assert lw.nbytes() == sum(v.numel() * 2 for v in load_file(str(path / "adapter_model.safetensors")).values())


def test_compute_sha256_matches_hashlib(golden: Path) -> None:
    f = golden / "adapter_model.safetensors"
    assert compute_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_base_model_name_recorded(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    edit_config(path, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    assert parse_adapter_spec("b", path, mc, MAX_RANK).base_model_name_or_path == "meta-llama/Llama-3.2-1B"
    assert parse_adapter_spec("g", golden, mc, MAX_RANK).base_model_name_or_path is None

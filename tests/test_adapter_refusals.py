"""manylora.engine.adapters.spec refusing bad adapters at registration and at load, by name and reason (real PEFT
adapters edited,
and malformed safetensors files fuzzed)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft_adapters import (
    MAX_RANK,
    copy_of,
    edit_config,
    edit_weights,
    make_adapter,
    model_config,
)
from safetensors.torch import save_file

from manylora.engine.adapters.spec import parse_adapter_spec
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.errors import AdapterError
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
# refusals at registration


def _rm(path: Path, name: str) -> None:
    (path / name).unlink()


def _drop_key(fragment: str) -> Callable[[Path], None]:
    return lambda p: edit_weights(p, lambda t: {k: v for k, v in t.items() if fragment not in k})


def _add_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Callable[[Path], None]:
    return lambda p: edit_weights(p, lambda t: {**t, key: torch.zeros(shape, dtype=dtype)})


def _bin_only(p: Path) -> None:
    torch.save({}, p / "adapter_model.bin")
    _rm(p, "adapter_model.safetensors")


def _truncate(p: Path) -> None:
    f = p / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
REFUSALS: dict[str, tuple[Callable[[Path], None], str]] = {
    "config_missing": (lambda p: _rm(p, "adapter_config.json"), "adapter_config.json not found"),
    "config_bad_json": (lambda p: (p / "adapter_config.json").write_text("{not json"), "not valid JSON"),
    "config_not_object": (lambda p: (p / "adapter_config.json").write_text("[1]"), "must hold a JSON object"),
    "peft_type": (lambda p: edit_config(p, peft_type="IA3"), "peft_type is 'IA3'"),
    "dora": (lambda p: edit_config(p, use_dora=True), "DoRA is not supported"),
    "modules_to_save": (lambda p: edit_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    "bias": (lambda p: edit_config(p, bias="lora_only"), "bias is 'lora_only'"),
    "fan_in_fan_out": (lambda p: edit_config(p, fan_in_fan_out=True), "fan_in_fan_out"),
    "lora_bias": (lambda p: edit_config(p, lora_bias=True), "lora_bias=True is not supported"),
    "target_lm_head": (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]), "'lm_head' is not supported"),
    "target_embed": (
        lambda p: (
            edit_config(p, target_modules=".*"),
            _add_tensor("base_model.model.model.embed_tokens.lora_embedding_A", (4, 64))(p),
        ),
        "module 'embed_tokens' is not supported",
    ),
    "weights_lm_head": (
        lambda p: (
            edit_config(p, target_modules="all-linear"),
            _add_tensor("base_model.model.lm_head.lora_A.weight", (4, 32))(p),
        ),
        "module 'lm_head' is not supported",
    ),
    "proj_in_wrong_block": (
        _add_tensor("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", (4, 32)),
        "q_proj belongs under '.self_attn.'",
    ),
    "a_without_b": (_drop_key("layers.1.mlp.up_proj.lora_B"), "has no matching lora_B"),
    "b_without_a": (_drop_key("layers.1.mlp.up_proj.lora_A"), "has no matching lora_A"),
    "no_weights": (lambda p: save_file({}, str(p / "adapter_model.safetensors")), "no LoRA weights"),
    "bin_only": (_bin_only, "only safetensors adapters are supported"),
    "no_weights_file": (lambda p: _rm(p, "adapter_model.safetensors"), "adapter_model.safetensors not found"),
    "truncated": (_truncate, "is not a valid safetensors file"),
    "garbage_file": (
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{oops"),
        "is not a valid safetensors file",
    ),
    "int_dtype": (lambda p: edit_weights(p, lambda t: {**t, A0: t[A0].to(torch.int32)}), "has dtype I32"),
    "one_d": (lambda p: edit_weights(p, lambda t: {**t, A0: t[A0].flatten()}), "expected a 2-D matrix"),
    "a_wrong_in": (lambda p: edit_weights(p, lambda t: {**t, A0: torch.zeros(4, 31)}), f"'{A0}' has shape [4, 31]"),
    "layers_to_transform_extra": (
        lambda p: edit_config(p, layers_to_transform=[0, 1]),
        "weights do not match layers_to_transform [0, 1]",
    ),
    "layers_to_transform_missing": (
        lambda p: (edit_config(p, layers_to_transform=[0, 1, 2]), _drop_key("layers.2.")(p)),
        "no weights for [2]",
    ),
    "layers_to_transform_too_deep": (lambda p: edit_config(p, layers_to_transform=[0, 1, 2, 7]), "[7] >= "),
    "rank_pattern_disagrees": (lambda p: edit_config(p, rank_pattern={"v_proj": 2}), "declares r=2"),
    "r_disagrees": (lambda p: edit_config(p, r=8), "declares r=8"),
    "rank_pattern_bad_regex": (lambda p: edit_config(p, rank_pattern={"q_proj(": 2}), "cannot be interpreted"),
    "rank_pattern_bad_value": (lambda p: edit_config(p, rank_pattern={"q_proj": "x"}), "must be a positive integer"),
    "layers_to_transform_bad": (lambda p: edit_config(p, layers_to_transform="all"), "layers_to_transform must be"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(case: str, golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    mutate, reason = REFUSALS[case]
    path = copy_of(golden, tmp_path)
    mutate(path)
    with pytest.raises(AdapterError) as ei:
        parse_adapter_spec(f"bad-{case}", path, mc, MAX_RANK)
    msg = str(ei.value)
    assert f"bad-{case}" in msg and ei.value.adapter == f"bad-{case}"
    assert reason in msg, msg


def test_refuses_missing_directory(tmp_path: Path, mc: ModelConfig) -> None:
    with pytest.raises(AdapterError, match="'gone'.*does not exist"):
        parse_adapter_spec("gone", tmp_path / "nope", mc, MAX_RANK)


def test_refuses_rank_above_max(tmp_path: Path, mc: ModelConfig) -> None:
    make_adapter(tmp_path, r=64, lora_alpha=64, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="'big'.*rank 64 exceeds max_lora_rank 16"):
        parse_adapter_spec("big", tmp_path, mc, 16)
    assert parse_adapter_spec("big", tmp_path, mc, 64).rank == 64


def test_refuses_adapter_for_another_base(tmp_path: Path, mc: ModelConfig) -> None:
    make_adapter(tmp_path, base={"hidden_size": 64, "num_attention_heads": 8})
    with pytest.raises(AdapterError) as ei:
        parse_adapter_spec("other", tmp_path, mc, MAX_RANK)
    msg = str(ei.value)
    assert "'other'" in msg and "has shape [64, 4], expected [32, 4]" in msg and "another base model" in msg


def test_refuses_layer_beyond_base(golden: Path, mc: ModelConfig) -> None:
    shallow = model_config(num_hidden_layers=2)
    with pytest.raises(AdapterError, match="'deep'.*layer index 2 >= the base model's num_layers 2"):
        parse_adapter_spec("deep", golden, shallow, MAX_RANK)


# ----------------------------------------------------------------------------------------------------------------------
# refusals at load


def test_load_refuses_changed_file(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    spec = parse_adapter_spec("moved", path, mc, MAX_RANK)
    edit_weights(path, lambda t: {k: v * 2 for k, v in t.items()})
    with pytest.raises(AdapterError, match="'moved'.*changed since registration"):
        load_adapter_weights(spec, mc)


def test_unchanged_file_is_not_rehashed_changed_one_is(golden: Path, tmp_path: Path, mc: ModelConfig,
                                                      monkeypatch) -> None:
    """A file whose stamp is unchanged since registration loads without hashing it again (unless asked);
    one that changed is hashed and refused. Files changed within STAMP_MIN_AGE_S are always hashed."""
    import manylora.engine.adapters.spec as adapter_module

    path = copy_of(golden, tmp_path)
    fresh = parse_adapter_spec("fresh", path, mc, MAX_RANK)
    assert fresh.file_stamp is None  # just written: its timestamps may not have ticked yet
    monkeypatch.setattr(adapter_module, "STAMP_MIN_AGE_S", 0.0)
    spec = parse_adapter_spec("settled", path, mc, MAX_RANK)
    assert spec.file_stamp is not None
    hashed = []
    real = adapter_module.hashlib.sha256

    def counting(data=b""):
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(adapter_module.hashlib, "sha256", counting)
    load_adapter_weights(spec, mc)
    assert hashed == []
    load_adapter_weights(spec, mc, rehash=True)
    assert len(hashed) == 1
    load_adapter_weights(fresh, mc)
    assert len(hashed) == 2
    with open(path / "adapter_model.safetensors", "ab") as f:  # a changed file (its size differs)
        f.write(b"\0" * 16)
    with pytest.raises(AdapterError, match="'settled'.*changed since registration"):
        load_adapter_weights(spec, mc)
    assert len(hashed) == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_load_refuses_non_finite(bad: float, golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    key = "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight"

    def poison(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t[key] = t[key].clone()
        t[key][3, 1] = bad
        return t

    edit_weights(path, poison)
    spec = parse_adapter_spec("nan", path, mc, MAX_RANK)  # header only: registration cannot see values
    with pytest.raises(AdapterError, match=rf"'nan'.*tensor '{key}' has 1 non-finite"):
        load_adapter_weights(spec, mc)


def test_load_refuses_overflow_in_conversion(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    edit_weights(path, lambda t: {**t, A0: t[A0] * 1e6})
    spec = parse_adapter_spec("huge", path, mc, MAX_RANK)
    load_adapter_weights(spec, mc)  # fine in float32
    with pytest.raises(AdapterError, match=rf"'huge'.*'{A0}' overflows torch.float16"):
        load_adapter_weights(spec, mc, dtype=torch.float16)


def test_load_refuses_deleted_file(golden: Path, tmp_path: Path, mc: ModelConfig) -> None:
    path = copy_of(golden, tmp_path)
    spec = parse_adapter_spec("del", path, mc, MAX_RANK)
    _rm(path, "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="'del'.*cannot read"):
        load_adapter_weights(spec, mc)


# ----------------------------------------------------------------------------------------------------------------------
# fuzz: malformed files raise AdapterError, never anything else


@st.composite
def mutated_file(draw: st.DrawFn, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "header", "header_len"]))
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        buf = bytearray(data)
        # Bias towards the header, where structure lives.
        limit = draw(st.sampled_from([64, 8 + int.from_bytes(data[:8], "little"), len(data)]))
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, min(limit, len(data)) - 1))
            buf[i] = draw(st.integers(0, 255))
        return bytes(buf)
    if kind == "header_len":
        n = draw(st.integers(0, 2**64 - 1))
        return n.to_bytes(8, "little") + data[8:]
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
    entry = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I32", "F64", "X"]) | json_values,
            "shape": st.lists(st.integers(-2, 40), max_size=3) | json_values,
            "data_offsets": st.lists(st.integers(-2, 600), min_size=2, max_size=2) | json_values,
        }
    )
    key = st.sampled_from([A0, A0.replace("lora_A", "lora_B"), "__metadata__", "x"]) | st.text(max_size=12)
    header = draw(st.dictionaries(key, entry | json_values, max_size=4))
    raw = json.dumps(header).encode()
    body = draw(st.binary(max_size=600))
    return len(raw).to_bytes(8, "little") + raw + body


@pytest.fixture(scope="module")
def fuzz_seed(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A one-module adapter (small header, small body) and its safetensors bytes."""
    path = tmp_path_factory.mktemp("fuzz") / "adapter"
    shutil.copytree(golden, path)
    edit_config(path, target_modules=["q_proj"])
    edit_weights(path, lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.q_proj" in k})
    return path, (path / "adapter_model.safetensors").read_bytes()


def test_fuzz_malformed_safetensors(fuzz_seed: tuple[Path, bytes], mc: ModelConfig) -> None:
    path, seed = fuzz_seed

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(blob=mutated_file(seed))
    def check(blob: bytes) -> None:
        (path / "adapter_model.safetensors").write_bytes(blob)
        try:
            spec = parse_adapter_spec("fuzz", path, mc, MAX_RANK)
            load_adapter_weights(spec, mc)
        except AdapterError as e:
            assert e.adapter == "fuzz"

    check()

"""The embedded default model build: layout, loadability, adapters' effect, marker skip, determinism."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from manylora.embedded import build as embedded

STEPS, ADAPTER_STEPS = 120, 60  # enough for distinct greedy outputs, a few seconds to build
PROMPTS = ("Every Saturday there is a market", "Anna likes to sit by the river", "The weather today is")
ROUND_TRIP = "Crème brûlée at the café, a naïve fox, 東京 and Москва 🙂🦊!"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reduced build shared by the tests of this module."""
    return embedded.build_default(tmp_path_factory.mktemp("emb") / "default", steps=STEPS,
                                  adapter_steps=ADAPTER_STEPS, summary=False)


@pytest.fixture(scope="module")
def params() -> embedded.BuildParams:
    """The parameters the shared build used."""
    return embedded.BuildParams(steps=STEPS, adapter_steps=ADAPTER_STEPS)


def _greedy_ids(model, input_ids: torch.Tensor, n: int = 12) -> list[int]:
    """Exactly ``n`` greedy tokens (EOS cannot cut the comparison short)."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, input_ids.shape[1]:].tolist()


def test_every_file_exists(built: Path, params: embedded.BuildParams) -> None:
    assert built.is_absolute()
    for path in embedded.expected_files(built, params):
        assert path.is_file(), path
        assert path.stat().st_mode & 0o044 == 0o044, f"{path} is not world-readable"
    assert (built / embedded.MARKER_NAME).is_file()
    assert embedded.is_complete(built, params)


def test_base_config_shape(built: Path) -> None:
    config = json.loads((built / "base" / "config.json").read_text())
    tokenizer = json.loads((built / "base" / "tokenizer.json").read_text())
    generation = json.loads((built / "base" / "generation_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (4, 64, 176)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 512
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    vocab = tokenizer["model"]["vocab"]
    assert config["vocab_size"] == len(vocab) + len([t for t in tokenizer["added_tokens"] if t["content"] not in vocab])
    assert 512 <= config["vocab_size"] <= 1024
    assert config["bos_token_id"] == generation["bos_token_id"] == vocab["<s>"]
    assert config["eos_token_id"] == generation["eos_token_id"] == vocab["</s>"]


def test_tokenizer_round_trips_utf8(built: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(built / "base" / "tokenizer.json"))
    enc = raw.encode(ROUND_TRIP)
    assert enc.ids[0] == raw.token_to_id("<s>")
    assert raw.decode(enc.ids, skip_special_tokens=True) == ROUND_TRIP
    assert len(raw.encode("🦊", add_special_tokens=False).ids) > 1  # a multi-byte character split across tokens
    hf = AutoTokenizer.from_pretrained(str(built / "base"))
    ids = hf(ROUND_TRIP).input_ids
    assert ids == enc.ids
    assert hf.decode(ids, skip_special_tokens=True) == ROUND_TRIP
    assert (hf.bos_token, hf.eos_token) == ("<s>", "</s>")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_adapters_load_and_change_greedy_output(built: Path, params: embedded.BuildParams) -> None:
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built / "base"))
    base = AutoModelForCausalLM.from_pretrained(str(built / "base"), dtype=torch.float32).eval()
    inputs = [tok(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
    base_out = [_greedy_ids(base, ids) for ids in inputs]
    outputs = {}
    for spec in params.adapters:
        model = PeftModel.from_pretrained(copy.deepcopy(base), str(built / "adapters" / spec.name)).eval()
        outputs[spec.name] = [_greedy_ids(model, ids) for ids in inputs]
        assert outputs[spec.name] != base_out, f"adapter {spec.name} does not change the greedy output"
    distinct = {tuple(map(tuple, out)) for out in outputs.values()}
    assert len(distinct) == len(outputs), "two adapters behave the same"


def test_adapter_configs_differ_and_lora_b_trained(built: Path, params: embedded.BuildParams) -> None:
    configs = {s.name: json.loads((built / "adapters" / s.name / "adapter_config.json").read_text())
               for s in params.adapters}
    assert len(configs) >= 4
    for a, b in itertools.combinations(configs.values(), 2):
        assert a["r"] != b["r"]
        assert a["target_modules"] != b["target_modules"]
    assert any(c["use_rslora"] for c in configs.values())
    assert any(c["layers_to_transform"] for c in configs.values())
    assert any(c["lora_alpha"] != c["r"] for c in configs.values())
    for name, config in configs.items():
        assert config["task_type"] == "CAUSAL_LM" and config["peft_type"] == "LORA"
        tensors = load_file(str(built / "adapters" / name / "adapter_model.safetensors"))
        b_keys = [k for k in tensors if "lora_B" in k]
        assert b_keys, name
        for key in b_keys:
            assert tensors[key].abs().sum() > 0, f"{name}: {key} is all zeros"
        layers = {int(k.split(".layers.")[1].split(".")[0]) for k in tensors}
        if config["layers_to_transform"]:
            assert layers == set(config["layers_to_transform"])


def test_catalogue_paths_exist(built: Path, params: embedded.BuildParams) -> None:
    catalogue = json.loads((built / "catalogue.json").read_text())
    assert sorted(catalogue) == sorted(s.name for s in params.adapters)
    for path in catalogue.values():
        assert Path(path).is_absolute()
        assert (Path(path) / "adapter_config.json").is_file()


def test_rebuild_with_same_params_is_skipped(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = built / "base" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    embedded.build_default(built, steps=STEPS, adapter_steps=ADAPTER_STEPS, summary=False)
    assert "skipping" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns == before


def test_changed_params_are_not_complete(built: Path) -> None:
    assert not embedded.is_complete(built, embedded.BuildParams(steps=STEPS + 1, adapter_steps=ADAPTER_STEPS))
    assert not embedded.is_complete(built, embedded.BuildParams(steps=STEPS, adapter_steps=ADAPTER_STEPS, seed=1))


def test_refuses_to_clear_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        embedded.build_default(tmp_path, steps=1, adapter_steps=1, summary=False)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    dirs = [embedded.build_default(tmp_path / name, steps=10, adapter_steps=3, summary=False) for name in "ab"]
    relative = ["base/model.safetensors", "base/tokenizer.json", "base/config.json"]
    relative += [f"adapters/{s.name}/{f}" for s in embedded.DEFAULT_ADAPTERS
                 for f in ("adapter_model.safetensors", "adapter_config.json")]
    for rel in relative:
        first, second = ((d / rel).read_bytes() for d in dirs)
        if rel.startswith("adapters/") and rel.endswith(".json"):  # base_model_name_or_path differs
            first, second = (json.loads(x) for x in (first, second))
            for config in (first, second):
                config.pop("base_model_name_or_path")
        assert first == second, f"{rel} differs between two builds"

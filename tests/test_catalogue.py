"""manylora.engine.adapters.catalogue: catalogue files, registration, lookup, pinning, and registration speed."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from manylora.engine.adapters.catalogue import (
    AdapterCatalogue,
    CatalogueEntry,
    CatalogueError,
    load_catalogue_file,
    validate_adapter_name,
)
from manylora.engine.adapters.spec import compute_sha256
from manylora.engine.errors import AdapterError, ErrorCode, RequestError
from manylora.engine.model_config import ModelConfig

TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def make_adapter(path: Path, r: int = 4, seed: int = 0) -> None:
    """Save a tiny random PEFT LoRA adapter (q_proj, v_proj) to ``path``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_()
        pm.save_pretrained(str(path))


@pytest.fixture(scope="module")
def mc() -> ModelConfig:
    d = LlamaConfig(**TINY).to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    return ModelConfig.from_dict(d)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A few valid adapters: r4, r8, and r32 (above the catalogue's max rank 16)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, r in (("r4", 4), ("r8", 8), ("r32", 32)):
        make_adapter(root / name, r=r, seed=r)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> dict[str, str]:
    """2,000 adapter directories holding copies of the same files."""
    root = tmp_path_factory.mktemp("many")
    src = adapters["r4"]
    mapping = {}
    for i in range(2000):
        d = root / f"a{i:04d}"
        d.mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(src / f, d / f)
        mapping[f"adapter-{i:04d}"] = str(d)
    return mapping


def catalogue(mc: ModelConfig) -> AdapterCatalogue:
    return AdapterCatalogue(mc, max_lora_rank=16)


# ----------------------------------------------------------------------------------------------------------------------
# catalogue files


def test_load_catalogue_file_forms_and_relative_paths(tmp_path: Path, adapters: dict[str, Path]) -> None:
    sub = tmp_path / "conf"
    sub.mkdir()
    shutil.copytree(adapters["r4"], sub / "local" / "r4")
    sha = compute_sha256(adapters["r8"] / "adapter_model.safetensors")
    (sub / "multi_lora.json").write_text(
        json.dumps(
            {
                "plain": str(adapters["r4"]),
                "relative": "local/r4",
                "pinned": {"path": str(adapters["r8"]), "sha256": sha.upper()},
            }
        )
    )
    entries = load_catalogue_file(sub / "multi_lora.json")
    assert list(entries) == ["plain", "relative", "pinned"]
    assert entries["plain"] == CatalogueEntry(str(adapters["r4"]))
    assert entries["relative"] == CatalogueEntry(str(sub / "local" / "r4"))
    assert entries["pinned"] == CatalogueEntry(str(adapters["r8"]), sha)


def test_catalogue_file_registers(tmp_path: Path, adapters: dict[str, Path], mc: ModelConfig) -> None:
    shutil.copytree(adapters["r4"], tmp_path / "x")
    (tmp_path / "cat.json").write_text(json.dumps({"x": "x", "y": {"path": str(adapters["r8"])}}))
    cat = catalogue(mc)
    assert cat.register_all(load_catalogue_file(tmp_path / "cat.json")) == {}
    assert cat.names() == ["x", "y"] and cat.resolve("y").rank == 8
    assert cat.resolve("x").path == str(tmp_path / "x")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{nope", "not valid JSON"),
        ('["a"]', "must hold a JSON object"),
        ('{"a": "/x", "a": "/y"}', "adapter name 'a' appears twice"),
    ],
)
def test_catalogue_file_errors(tmp_path: Path, text: str, reason: str) -> None:
    f = tmp_path / "cat.json"
    f.write_text(text)
    with pytest.raises(CatalogueError) as ei:
        load_catalogue_file(f)
    assert str(f) in str(ei.value) and reason in str(ei.value)
    assert isinstance(ei.value, AdapterError)


def test_catalogue_file_missing(tmp_path: Path) -> None:
    with pytest.raises(CatalogueError, match="file not found"):
        load_catalogue_file(tmp_path / "none.json")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (3, "catalogue value must be a path"),
        ({"path": ""}, "non-empty 'path'"),
        ({"sha256": "ab" * 32}, "non-empty 'path'"),
        ({"path": "/x", "sha256": "abc"}, "64 hex digits"),
        ({"path": "/x", "revision": "main"}, "unknown catalogue fields ['revision']"),
    ],
)
def test_catalogue_file_bad_values(tmp_path: Path, value: object, reason: str) -> None:
    f = tmp_path / "cat.json"
    f.write_text(json.dumps({"good-name": value}))
    with pytest.raises(AdapterError) as ei:
        load_catalogue_file(f)
    assert "'good-name'" in str(ei.value) and reason in str(ei.value)


BAD_NAMES = {
    "": "must not be empty",
    "../x": "may contain only",
    "..": "must not start with '.'",
    ".hidden": "must not start with '.'",
    "a/b": "may contain only",
    "a b": "may contain only",
    "é": "may contain only",
    "x" * 129: "at most 128",
}


@pytest.mark.parametrize("name", sorted(BAD_NAMES))
def test_bad_names_refused(name: str, tmp_path: Path, adapters: dict[str, Path], mc: ModelConfig) -> None:
    with pytest.raises(AdapterError, match=BAD_NAMES[name]):
        validate_adapter_name(name)
    f = tmp_path / "cat.json"
    f.write_text(json.dumps({name: str(adapters["r4"])}))
    with pytest.raises(AdapterError, match=BAD_NAMES[name]):
        load_catalogue_file(f)
    with pytest.raises(AdapterError, match=BAD_NAMES[name]):
        catalogue(mc).register(name, adapters["r4"])


def test_good_names(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    for name in ("a", "A-1_b.c", "x" * 128, "sql.v2"):
        assert validate_adapter_name(name) == name
        cat.register(name, adapters["r4"])
    assert len(cat) == 4


# ----------------------------------------------------------------------------------------------------------------------
# registration and lookup


def test_register_resolve_and_listing(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    assert len(cat) == 0 and cat.names() == [] and cat.specs() == []
    s8 = cat.register("b-r8", adapters["r8"])
    s4 = cat.register("a-r4", str(adapters["r4"]))
    assert s4.rank == 4 and s8.rank == 8
    assert len(cat) == 2 and "a-r4" in cat and "zzz" not in cat
    assert cat.names() == ["a-r4", "b-r8"]
    assert cat.specs() == [s4, s8]
    assert cat.get("b-r8") is s8 and cat.resolve("a-r4") is s4
    with pytest.raises(KeyError, match="zzz"):
        cat.get("zzz")


def test_resolve_not_found_lists_names(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    with pytest.raises(RequestError) as ei:
        cat.resolve("x")
    assert ei.value.code == ErrorCode.NOT_FOUND
    assert ei.value.message == "unknown adapter 'x'; no adapters are registered"
    cat.register_all({"c": str(adapters["r4"]), "a": str(adapters["r4"]), "b": str(adapters["r8"])})
    with pytest.raises(RequestError) as ei:
        cat.resolve("x")
    assert ei.value.code == ErrorCode.NOT_FOUND
    assert ei.value.message == "unknown adapter 'x'; registered: a, b, c"
    cat.register_all({f"n{i:02d}": str(adapters["r4"]) for i in range(12)})
    with pytest.raises(RequestError) as ei:
        cat.resolve("x")
    assert ei.value.message == (
        "unknown adapter 'x'; registered: a, b, c, n00, n01, n02, n03, n04, n05, n06 (and 5 more)"
    )


def test_duplicate_registration_refused(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    cat.register("a", adapters["r4"])
    with pytest.raises(AdapterError, match="'a'.*already registered"):
        cat.register("a", adapters["r8"])
    assert cat.resolve("a").rank == 4


def test_pinned_sha256(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    sha = compute_sha256(adapters["r4"] / "adapter_model.safetensors")
    assert cat.register("ok", adapters["r4"], pinned_sha256=sha).sha256 == sha
    with pytest.raises(AdapterError) as ei:
        cat.register("pinned", adapters["r8"], pinned_sha256=sha)
    assert "'pinned'" in str(ei.value) and f"sha256 mismatch: the catalogue pins {sha}" in str(ei.value)
    with pytest.raises(AdapterError, match="'viaall'.*sha256 mismatch"):
        cat.register_all({"viaall": {"path": str(adapters["r8"]), "sha256": sha}})
    assert cat.names() == ["ok"]


def test_register_all_strict_stops_at_first_bad(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    mapping = {"good": str(adapters["r4"]), "too-big": str(adapters["r32"]), "missing": "/nonexistent/x"}
    with pytest.raises(AdapterError) as ei:
        cat.register_all(mapping)
    assert ei.value.adapter == "too-big" and "rank 32 exceeds max_lora_rank 16" in str(ei.value)
    assert len(cat) == 0 and cat.refused() == []  # nothing of a failed strict batch is registered or remembered


def test_register_all_lenient_returns_errors(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    mapping = {"good": str(adapters["r4"]), "too-big": str(adapters["r32"]), "missing": "/nonexistent/x", "../x": "/"}
    errors = cat.register_all(mapping, strict=False)
    assert sorted(errors) == ["../x", "missing", "too-big"]
    assert "does not exist" in str(errors["missing"])
    assert cat.names() == ["good"]


def test_register_all_lenient_remembers_refusals(
    adapters: dict[str, Path], mc: ModelConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="manylora.catalogue")
    cat = catalogue(mc)
    missing = str(tmp_path / "gone")
    mapping = {"good": str(adapters["r4"]), "too-big": str(adapters["r32"]), "missing": missing}
    assert sorted(cat.register_all(mapping, strict=False)) == ["missing", "too-big"]
    refused = {r.name: r for r in cat.refused()}
    assert list(refused) == ["missing", "too-big"]
    # the reason, which tenants see, names no server path; the path is kept apart for the operator
    assert refused["missing"].path == missing and refused["missing"].reason == "directory <adapter dir> does not exist"
    assert refused["too-big"].path == str(adapters["r32"])
    assert refused["too-big"].reason.startswith("rank 32 exceeds max_lora_rank 16")
    with pytest.raises(RequestError) as ei:
        cat.resolve("missing")
    assert ei.value.code == ErrorCode.NOT_FOUND
    assert ei.value.message == "adapter 'missing' was refused at startup: directory <adapter dir> does not exist"
    warnings = [r.getMessage() for r in caplog.records if r.name == "manylora.catalogue"]
    assert len(warnings) == 2, warnings
    assert any("'missing'" in w and missing in w and "does not exist" in w for w in warnings), warnings
    # a bad new version of a registered name is not a refusal: the registered version goes on serving
    assert sorted(cat.register_all({"good": missing}, strict=False)) == ["good"]
    assert cat.resolve("good").rank == 4 and [r.name for r in cat.refused()] == ["missing", "too-big"]
    # a name registered later (the operator fixed it) is refused no more
    cat.register("missing", adapters["r8"])
    cat.replace("too-big", adapters["r4"])
    assert cat.refused() == [] and cat.resolve("missing").rank == 8 and cat.resolve("too-big").rank == 4


def test_concurrent_registration(adapters: dict[str, Path], mc: ModelConfig) -> None:
    cat = catalogue(mc)

    def worker(k: int) -> None:
        for i in range(20):
            cat.register(f"t{k}-{i}", adapters["r4"])
            cat.resolve(f"t{k}-{i}")
            assert len(cat.names()) >= 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cat) == 80


def test_register_2000_adapters_fast(many: dict[str, str], mc: ModelConfig) -> None:
    cat = catalogue(mc)
    t0 = time.perf_counter()
    assert cat.register_all(many) == {}
    elapsed = time.perf_counter() - t0
    assert len(cat) == 2000
    assert elapsed < 5.0, f"registering 2,000 adapters took {elapsed:.2f} s"
    assert len({s.sha256 for s in cat.specs()}) == 1

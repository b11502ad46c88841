"""A bad adapter in the catalogue is refused alone: the engine starts and serves the others exactly as without it,
lists the refused one with its reason, fails requests naming it with that reason, and counts it; strict_adapters
fails the start instead, and a start that fails leaves no thread or process of the engine's behind."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import manylora.engine.scheduling.assembly as assembly_module
from manylora.engine.adapters.catalogue import CatalogueEntry
from manylora.engine.config import EngineConfig
from manylora.engine.errors import AdapterError, ErrorCode
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_base, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16
PROMPTS = [[0, 5, 17, 42], [0, 200, 3], [0, 9, 9, 120, 77, 31]]
# refused adapter -> what its reason says
REASONS = {
    "pickled": "has only adapter_model.bin",
    "missing": "does not exist",
    "too-big": f"rank 32 exceeds max_lora_rank {MAX_RANK}",
    "pinned-wrong": "sha256 mismatch",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused_alone")
    base = make_base(root / "base", "llama", seed=31)
    good = {
        "good-a": write_random_adapter(root / "good-a", base, rank=4, targets=ALL, seed=1),
        "good-b": write_random_adapter(root / "good-b", base, rank=2, targets=["q_proj", "v_proj"], seed=2),
    }
    pickled = root / "pickled"  # a good adapter shipped as a pickle, as older PEFT versions saved it
    shutil.copytree(good["good-a"], pickled)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    bad = {
        "pickled": str(pickled),
        "missing": str(root / "no-such-adapter"),
        "too-big": str(write_random_adapter(root / "too-big", base, rank=32, targets=["q_proj"], seed=3)),
        "pinned-wrong": CatalogueEntry(path=str(good["good-b"]), sha256="0" * 64),
    }
    return root, base, {k: str(v) for k, v in good.items()}, bad


def _config(base: Path, adapters: dict, **overrides) -> EngineConfig:
    return EngineConfig(model_dir=str(base), adapters=adapters, max_lora_rank=MAX_RANK, **overrides)


def _serve(engine: Engine, adapters: list[str | None]) -> dict[str | None, list]:
    """Every prompt on every adapter (None: the base alone), all at once; adapter -> the results, in PROMPTS order."""
    requests = [GenerationRequest(f"{a}-{i}", p, a, SamplingParams(max_tokens=8))
                for a in adapters for i, p in enumerate(PROMPTS)]
    results: dict[str | None, list] = {}
    for request, result in zip(requests, generate(engine, requests), strict=True):
        results.setdefault(request.adapter, []).append(result)
    return results


def test_bad_adapters_are_refused_alone(setup, caplog):
    root, base, good, bad = setup
    caplog.set_level(logging.WARNING, logger="manylora.catalogue")
    engine = Engine(_config(base, {**bad, **good}))  # the bad ones first in catalogue order
    reference = Engine(_config(base, good))
    try:
        served = [None, *sorted(good)]
        # the refused adapters' requests go in the same batch as the good ones: they fail, the others do not notice
        results = _serve(engine, [*served, *sorted(bad)])
        expected = _serve(reference, served)
        stats, listing = engine.stats(), engine.list_adapters()
    finally:
        engine.shutdown()
        reference.shutdown()
    for adapter in served:
        got, want = results[adapter], expected[adapter]
        assert all(r.error is None and r.token_ids for r in got + want), [(r.error, r.token_ids) for r in got]
        assert [r.token_ids for r in got] == [r.token_ids for r in want], adapter
    for name, reason in REASONS.items():
        for res in results[name]:
            assert res.error is not None and res.error.code is ErrorCode.NOT_FOUND, res.error
            message = res.error.message
            assert f"adapter '{name}' was refused at startup" in message and reason in message, message
            assert str(root) not in message, message  # tenants are not shown server paths

    assert stats["adapters_refused"] == len(bad) and stats["adapters_registered"] == len(good)
    assert [a["name"] for a in listing] == sorted([*good, *bad])
    for info in listing:
        assert "path" not in info and str(root) not in str(info), info
        if info["name"] in good:
            assert info["status"] == "ready" and info["rank"] in (2, 4) and len(info["sha256"]) == 64, info
        else:
            assert info["status"] == "refused" and REASONS[info["name"]] in info["reason"], info
            assert set(info) == {"name", "status", "reason"}, info

    warnings = [r.getMessage() for r in caplog.records if r.name == "manylora.catalogue"]
    for name, value in bad.items():
        path = value.path if isinstance(value, CatalogueEntry) else value
        named = [w for w in warnings if f"adapter '{name}'" in w]
        assert len(named) == 1 and path in named[0] and REASONS[name] in named[0], named
    assert len(warnings) == len(bad), warnings


def test_a_runtime_load_of_a_refused_name_clears_its_refusal(setup):
    root, base, good, _ = setup
    late = root / "late"  # the catalogue names it before it exists
    engine = Engine(_config(base, {**good, "late": str(late)}, allow_runtime_adapters=True))
    try:
        assert engine.stats()["adapters_refused"] == 1
        assert {a["name"]: a["status"] for a in engine.list_adapters()}["late"] == "refused"
        shutil.copytree(good["good-a"], late)
        info = engine.load_adapter("late", str(late))
        assert info["status"] == "ready" and "path" not in info
        assert engine.stats()["adapters_refused"] == 0
        assert {a["name"]: a["status"] for a in engine.list_adapters()}["late"] == "ready"
        same, ref = generate(engine, [GenerationRequest("late", PROMPTS[0], "late", SamplingParams(max_tokens=8)),
                                      GenerationRequest("ref", PROMPTS[0], "good-a", SamplingParams(max_tokens=8))])
        assert same.error is None and same.token_ids == ref.token_ids
    finally:
        engine.shutdown()


def test_listing_shows_paths_only_when_the_operator_enables_it(setup):
    _, base, good, bad = setup
    engine = Engine(_config(base, {**good, "missing": bad["missing"]}, list_adapter_paths=True,
                            allow_runtime_adapters=True))
    try:
        paths = {a["name"]: a.get("path") for a in engine.list_adapters()}
        assert paths == {**good, "missing": bad["missing"]}
        assert engine.unload_adapter("good-b")["path"] == good["good-b"]
        assert engine.load_adapter("good-b", good["good-b"])["path"] == good["good-b"]
    finally:
        engine.shutdown()


def _engine_threads_and_children() -> tuple[set[threading.Thread], set[int]]:
    """The live non-daemon threads and the live child processes of this process."""
    return ({t for t in threading.enumerate() if not t.daemon and t.is_alive()},
            {p.pid for p in multiprocessing.active_children()})


def _assert_nothing_left(before: tuple[set[threading.Thread], set[int]], timeout: float = 60.0) -> None:
    """What the failed start had started is gone (shutting down a process pool joins its children in the
    background: give it a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        threads, children = (now - then for now, then in zip(_engine_threads_and_children(), before, strict=True))
        if not threads and not children:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left behind after a failed start: threads {[t.name for t in threads]}, "
                        f"child processes {sorted(children)}")
        time.sleep(0.2)


def test_strict_adapters_fails_the_start_naming_the_first_bad_adapter(setup):
    _, base, good, bad = setup
    before = _engine_threads_and_children()
    with pytest.raises(AdapterError) as err:
        Engine(_config(base, {**good, **bad}, strict_adapters=True, adapter_load_processes=1))
    assert err.value.adapter == "pickled" and REASONS["pickled"] in str(err.value), err.value
    _assert_nothing_left(before)


class _FailingScheduler:
    """Stands in for the scheduler, the first part built after the adapter tiers: a start that fails there has
    loader threads and processes (and, with tensor parallelism, ranks) running."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("injected: the start fails after the adapter loaders started")


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_start_that_fails_part_way_stops_what_it_started(setup, monkeypatch, tensor_parallel_size):
    _, base, good, _ = setup
    before = _engine_threads_and_children()
    monkeypatch.setattr(assembly_module, "Scheduler", _FailingScheduler)
    config = _config(base, good, adapter_load_processes=1, tensor_parallel_size=tensor_parallel_size)
    with pytest.raises(RuntimeError, match="injected"):
        Engine(config)
    _assert_nothing_left(before)


def test_config_strings_parse():
    cfg = EngineConfig.from_strings({"strict_adapters": "true", "list_adapter_paths": "false"}, model_dir="m")
    assert cfg.strict_adapters is True and cfg.list_adapter_paths is False
    cfg = EngineConfig.from_strings({"strict_adapters": "false", "list_adapter_paths": "true"}, model_dir="m")
    assert cfg.strict_adapters is False and cfg.list_adapter_paths is True
    default = EngineConfig(model_dir="m")
    assert default.strict_adapters is False and default.list_adapter_paths is False
    with pytest.raises(ValueError, match="expected a boolean"):
        EngineConfig.from_strings({"strict_adapters": "sometimes"}, model_dir="m")

"""Adapters loaded in child processes: the same pages as a load in the engine's process, errors named
per adapter, no files left behind, a killed child survived; the engine serves PEFT's output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.packing import _layout
from manylora.engine.adapters.process_loader import ProcessLoader
from manylora.engine.adapters.spec import parse_adapter_spec
from manylora.engine.config import EngineConfig
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import ModelConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import assert_pool_drained, make_base, peft_greedy, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAGE_ELEMS = 4096


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("process_loader") / "base", "llama", seed=29)


def _same_pages(a, b, cfg: ModelConfig) -> bool:
    """Equal wherever a rank row lies (page space after a page's last row is never read, nor set)."""
    _, rows = _layout(a.spec, cfg, PAGE_ELEMS)
    flat_a, flat_b = a.data.reshape(-1), b.data.reshape(-1)
    return a.data.shape == b.data.shape and all(
        torch.equal(flat_a[offset:offset + length], flat_b[offset:offset + length]) for *_, offset, length in rows)


def _files_of(directory: str, pids: set[int]) -> list[Path]:
    """Packed-adapter files the children with these pids wrote and nobody unlinked."""
    return [p for pid in pids for p in Path(directory).glob(f"manylora-adapter-{pid}-*")]


def test_pages_equal_a_load_in_this_process_and_errors_name_the_adapter(base, tmp_path):
    cfg = ModelConfig.from_dir(base)
    rng = random.Random(3)
    specs = [parse_adapter_spec(f"a{i}", write_random_adapter(tmp_path / f"a{i}", base, rank=rng.choice([1, 4, 8]),
                                                             targets=rng.sample(ALL, rng.randint(1, 7)), seed=i),
                                cfg, 16) for i in range(5)]
    bad_path = write_random_adapter(tmp_path / "bad", base, rank=2, targets=["q_proj"], seed=9)
    bad = parse_adapter_spec("poisoned", bad_path, cfg, 16)  # registered, then the file changes on disk
    weights_file = bad_path / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights_file)

    here = HostAdapterCache(cfg, torch.float32, PAGE_ELEMS, 16, capacity=None, pin_memory=False, workers=1)
    there = HostAdapterCache(cfg, torch.float32, PAGE_ELEMS, 16, capacity=None, pin_memory=False, workers=2,
                             processes=2)
    try:
        for spec in specs:
            a, b = here.wait(spec, timeout=60), there.wait(spec, timeout=60)
            assert _same_pages(a, b, cfg), spec.name
            for table in ("row_offsets", "ranks", "scalings"):
                assert torch.equal(getattr(a, table), getattr(b, table)), (spec.name, table)
        with pytest.raises(AdapterError, match="'poisoned'.*changed since registration"):
            there.wait(bad, timeout=60)
        assert there.get(specs[0]) is not None  # the others are unaffected
        children = {p.pid for p in there._processes._pool._processes.values()}
        assert len(children) == 2
        assert not _files_of(there._processes.directory, children), "packed files must be unlinked once mapped"
    finally:
        here.shutdown()
        there.shutdown()


def test_a_killed_loader_process_is_replaced(base, tmp_path):
    cfg = ModelConfig.from_dir(base)
    specs = [parse_adapter_spec(f"k{i}", write_random_adapter(tmp_path / f"k{i}", base, rank=4, targets=ALL, seed=i),
                                cfg, 16) for i in range(3)]
    loader = ProcessLoader(1)
    try:
        loader.load(specs[0], cfg, cfg, torch.float32, PAGE_ELEMS, 16, rehash=False)
        for proc in list(loader._pool._processes.values()):
            proc.kill()
            proc.join()
        # the broken pool is noticed: this adapter is loaded in this process, the pool restarted
        packed = loader.load(specs[1], cfg, cfg, torch.float32, PAGE_ELEMS, 16, rehash=False)
        assert packed.num_pages > 0
        again = loader.load(specs[2], cfg, cfg, torch.float32, PAGE_ELEMS, 16, rehash=False)
        assert again.num_pages == packed.num_pages
        assert all(p.is_alive() for p in loader._pool._processes.values())
    finally:
        loader.shutdown()


def test_engine_with_loader_processes_matches_peft(base, tmp_path):
    adapters = {f"p{i}": write_random_adapter(tmp_path / f"p{i}", base, rank=2 + 2 * i, targets=ALL, seed=40 + i)
                for i in range(3)}
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 adapter_load_processes=2, max_num_seqs=4))
    rng = random.Random(11)
    names = [*adapters, None]
    requests = [GenerationRequest(f"q{i}", [0] + [rng.randrange(2, 290) for _ in range(rng.randint(2, 9))],
                                  names[i % 4], SamplingParams(max_tokens=6)) for i in range(8)]
    try:
        results = generate(engine, requests, timeout=120)
        assert engine.stats()["host_loads"] == 3
        assert_pool_drained(engine)
    finally:
        engine.shutdown()
    for req, res in zip(requests, results, strict=True):
        assert res.error is None, res.error
        adapter_dir = adapters[req.adapter] if req.adapter else None
        assert res.token_ids == peft_greedy(base, adapter_dir, req.prompt_ids, 6), req.request_id


def test_no_room_for_the_shared_file_falls_back_to_loading_here(base, tmp_path):
    cfg = ModelConfig.from_dir(base)
    spec = parse_adapter_spec("r", write_random_adapter(tmp_path / "r", base, rank=4, targets=ALL, seed=5), cfg, 16)
    loader = ProcessLoader(1)
    loader.directory = str(tmp_path / "no-such-directory")  # the child cannot create its file there
    try:
        packed = loader.load(spec, cfg, cfg, torch.float32, PAGE_ELEMS, 16, rehash=False)
    finally:
        loader.shutdown()
    here = HostAdapterCache(cfg, torch.float32, PAGE_ELEMS, 16, capacity=None, pin_memory=False, workers=1)
    try:
        assert _same_pages(packed, here.wait(spec, timeout=60), cfg)
    finally:
        here.shutdown()

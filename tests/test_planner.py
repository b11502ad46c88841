"""The capacity planner (python -m manylora.client plan) agrees with the engine page for page, on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from manylora.client.plan import parse_ranks, parse_size
from manylora.engine.config import EngineConfig
from manylora.engine.memory import sizing
from manylora.engine.memory.unified_pool import page_bytes
from manylora.engine.model_config import PROJECTIONS, ModelConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.assembly import num_pages
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_base, write_random_adapter

REPO = Path(__file__).resolve().parents[1]
NUM_PAGES, PAGE_SIZE = 96, 8


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("planner") / "base", "llama", seed=3)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("141GiB", 141 * 2**30), ("80GB", 80 * 10**9), ("1.5TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20),
     ("1000", 1000), ("24 GiB", 24 * 2**30), ("2g", 2 * 2**30)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12XB", "-3GiB", "1e3GB", "1.2.3GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_parse_ranks():
    assert parse_ranks("8:500,16:300,64:20") == {8: 500, 16: 300, 64: 20}
    assert parse_ranks("8:1, 8:2") == {8: 3}
    for bad in ("", "x:1", "8:y", "0:3"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


@pytest.mark.parametrize("rank", [4, 8])
def test_adapter_pages_equal_the_engines(base, tmp_path, rank):
    """A rank-r adapter on all 7 projections, resident after one request, holds sizing.adapter_pages pages."""
    adapter = write_random_adapter(tmp_path / f"r{rank}", base, rank=rank, targets=list(PROJECTIONS), seed=rank)
    config = EngineConfig(model_dir=str(base), adapters={"a": str(adapter)}, num_kv_pages=NUM_PAGES,
                          page_size=PAGE_SIZE, max_lora_rank=16, max_loras=2, max_num_seqs=2, cuda_graphs=False)
    engine = Engine(config)
    try:
        (done,) = generate(engine, [GenerationRequest("r", [0, 5, 9, 12], adapter="a",
                                                      sampling=SamplingParams(max_tokens=3))])
        assert done.error is None and done.token_ids
        cfg = engine.model_config
        assert engine.pool.num_pages == NUM_PAGES
        assert engine.pool.usage()["adapters"] == sizing.adapter_pages(cfg, rank, PAGE_SIZE)
        assert engine.pool.usage()["kv"] == 0  # the request's KV pages went back
        # one page: PAGE_SIZE KV tokens of every layer, K and V, as the engine's storage holds it
        assert engine.pool.storage.numel() * engine.pool.storage.element_size() == \
            NUM_PAGES * page_bytes(cfg, PAGE_SIZE, engine.dtype)
        assert engine.kv.page_size == PAGE_SIZE
        assert [engine.kv.pages_needed(n) for n in (1, PAGE_SIZE, PAGE_SIZE + 1)] == [1, 1, 2]
        assert engine.model.weight_bytes() == sizing.weight_bytes(cfg, engine.dtype)
        assert sizing.adapter_weight_bytes(cfg, rank, engine.dtype, PROJECTIONS) == sum(
            p.stat().st_size for p in adapter.glob("*.safetensors")) - _safetensors_header(adapter)
    finally:
        engine.shutdown()


def _safetensors_header(adapter: Path) -> int:
    import struct

    (path,) = adapter.glob("*.safetensors")
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.fixture
def sized_on_gpu(base, monkeypatch):
    """An engine built on the CPU whose pool sizing then believes it is on a GPU with the free bytes given."""
    engine = Engine(EngineConfig(model_dir=str(base), num_kv_pages=4, page_size=PAGE_SIZE, cuda_graphs=False),
                    start=False)
    engine.config.num_kv_pages = None
    engine.device = "cuda"
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)

    def with_free(free: int) -> Engine:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free, 2 * free))
        return engine

    yield with_free
    engine.shutdown()


def _pool_pages(engine: Engine) -> int:
    """The pages the engine's pool gets with its config now, on its device (``assembly.num_pages``)."""
    return num_pages(engine.config, engine.pool_config, engine.device, engine.dtype, engine.max_len)


@pytest.mark.parametrize("free_gib", [10, 80, 139])
def test_pool_pages_from_free_is_the_engines_rule(sized_on_gpu, free_gib):
    """For the same free bytes, the engine (on CUDA, num_kv_pages unset) sizes its pool as the planner says."""
    free = free_gib * 2**30
    engine = sized_on_gpu(free)
    psize = page_bytes(engine.model_config, PAGE_SIZE, engine.dtype)
    assert _pool_pages(engine) == sizing.pool_pages_from_free(free, engine.config.gpu_memory_fraction, psize)


def test_too_little_free_gpu_memory_is_refused_with_the_numbers(sized_on_gpu):
    """A pool that cannot hold one max_model_len request beside one max-rank adapter stops start-up with
    the free memory and the knobs to turn, instead of serving from a 1-page pool that refuses everything."""
    with pytest.raises(RuntimeError, match=r"2\.0 GiB free.*max_model_len"):
        _pool_pages(sized_on_gpu(2 * 2**30))


def test_plan_capacity_numbers(base):
    cfg = ModelConfig.from_dir(base)
    gpu, ranks = 24 * 2**30, {4: 100, 8: 10}
    plan = sizing.plan_capacity(cfg, gpu, ranks, dtype=torch.bfloat16, page_size=PAGE_SIZE, max_loras=4,
                                prompt_len=100, output_len=28)
    psize = page_bytes(cfg, PAGE_SIZE, torch.bfloat16)
    free = gpu - sizing.weight_bytes(cfg, torch.bfloat16) - sizing.CUDA_CONTEXT_BYTES
    assert plan.pool_pages == sizing.pool_pages_from_free(free, 0.85, psize)
    assert plan.kv_tokens_if_no_adapters == plan.pool_pages * PAGE_SIZE
    assert [c.pool_pages for c in plan.rank_classes] == [sizing.adapter_pages(cfg, r, PAGE_SIZE) for r in (4, 8)]
    assert plan.hot_adapter_pages == 4 * sizing.adapter_pages(cfg, 8, PAGE_SIZE)
    assert plan.kv_tokens_with_hot_adapters == (plan.pool_pages - plan.hot_adapter_pages) * PAGE_SIZE
    assert plan.max_batch == (plan.pool_pages - plan.hot_adapter_pages) // (128 // PAGE_SIZE)


def test_plan_cli(base):
    command = [sys.executable, "-m", "manylora.client", "plan", "--base-model", str(base), "--gpu-memory", "80GB",
               "--ranks", "8:500,16:300", "--max-loras", "64", "--page-size", "16", "--prompt-len", "512",
               "--output-len", "512"]
    text = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    for words in ("pool", "KV tokens beside hot adapters", "largest batch", "max_loras=", "max_num_seqs="):
        assert words in text.stdout, text.stdout
    done = subprocess.run([*command, "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    cfg = ModelConfig.from_dir(base)
    assert [c["pool_pages"] for c in plan["rank_classes"]] == [sizing.adapter_pages(cfg, r, 16) for r in (8, 16)]
    assert plan["gpu_memory_bytes"] == 80 * 10**9
    bad = subprocess.run([*command[:6], "--gpu-memory", "lots", *command[8:]], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "not a size" in bad.stderr

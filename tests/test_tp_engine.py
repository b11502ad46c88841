"""The engine with tensor parallelism: rank 0 in the engine, rank 1 in a worker process (gloo on the CPU).

Output must equal the one-device engine's and the transformers + peft oracle token for token, with
adapters evicted and placed again in other pages while requests run (every rank must follow rank 0).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import assert_pool_drained, make_base, make_moe_base, peft_greedy, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    # biases on every projection: column-parallel ones are split, row-parallel ones added once after the sum
    base = make_base(root / "base", "llama", seed=23, heads=4, kv_heads=2, intermediate=96,
                     attention_bias=True, mlp_bias=True)
    adapters = {
        "all-r8": write_random_adapter(root / "a", base, rank=8, targets=ALL, seed=1),
        "qv-r2": write_random_adapter(root / "b", base, rank=2, targets=["q_proj", "v_proj"], seed=2),
        "mlp-r4": write_random_adapter(root / "c", base, rank=4, targets=["gate_proj", "down_proj", "o_proj"],
                                       seed=3),
        "all-r3": write_random_adapter(root / "d", base, rank=3, targets=ALL, seed=4),
    }
    return base, adapters


def _requests(adapters: dict, n: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    names = [*adapters, ""]
    return [GenerationRequest(f"r{i}", [0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 12))],
                              names[i % len(names)], SamplingParams(max_tokens=rng.randint(3, 8)))
            for i in range(n)]


def _config(base, adapters, tp: int) -> EngineConfig:
    # a pool that holds the KV of the running requests and about one large adapter: adapters are
    # evicted and placed again, in other pages, while requests run (a rank's pages are half as
    # large at tp=2, and its adapter shards, A whole for q/k/v/gate/up, more than half: more pages)
    return EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                        tensor_parallel_size=tp, max_num_seqs=4, max_loras=2, num_kv_pages=40 if tp == 1 else 70,
                        page_size=4, max_model_len=64)


@pytest.mark.parametrize("load_processes", [0, 2])  # 2: each rank's adapter shards read in children (CUDA's default)
def test_tp2_engine_equals_one_device_and_the_peft_oracle(setup, load_processes):
    base, adapters = setup
    requests = _requests(adapters, 15, seed=5)
    one = Engine(_config(base, adapters, 1))
    try:
        expected = generate(one, requests, timeout=120)
    finally:
        one.shutdown()
    two = Engine(dataclasses.replace(_config(base, adapters, 2), adapter_load_processes=load_processes))
    try:
        assert two.stats()["tensor_parallel_size"] == 2
        got = generate(two, requests, timeout=120)
        stats = two.stats()
        assert_pool_drained(two)
    finally:
        two.shutdown()
    assert stats["adapter_evictions"] > 0, "the pool should have been too small for every adapter at once"
    for req, a, b in zip(requests, expected, got, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert b.token_ids == a.token_ids, f"{req.request_id} ({req.adapter or 'base'}): tp=2 != tp=1"
    for req, res in list(zip(requests, got, strict=True))[:5]:  # one request of each adapter and the base
        adapter_dir = adapters[req.adapter] if req.adapter else None
        assert res.token_ids == peft_greedy(base, adapter_dir, req.prompt_ids, req.sampling.max_tokens), req


def test_tp_engine_refuses_uneven_heads_and_moe(setup, tmp_path):
    base, _ = setup
    with pytest.raises(ValueError, match="divisible by 3"):
        Engine(EngineConfig(model_dir=str(base), tensor_parallel_size=3), start=False)
    moe = make_moe_base(tmp_path / "moe", "mixtral", seed=1)
    with pytest.raises(ValueError, match="MoE"):
        Engine(EngineConfig(model_dir=str(moe), tensor_parallel_size=2), start=False)
    engine = Engine(EngineConfig(model_dir=str(base)), start=False)  # no process group left behind
    engine.shutdown()


def test_a_dead_rank_fails_requests_with_its_name_and_the_engine_stays_up(setup):
    base, adapters = setup
    engine = Engine(_config(base, adapters, 2))
    try:
        assert generate(engine, _requests(adapters, 2, seed=1), timeout=120)[0].error is None
        worker = engine.tp._procs[0]
        worker.kill()
        worker.join()
        results = generate(engine, _requests(adapters, 3, seed=2), timeout=120)
        assert all(r.error is not None and "tensor-parallel rank 1" in r.error.message for r in results), results
        assert engine._thread.is_alive()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family, extra", [("qwen3", {"head_dim": 24}), ("mistral", {"sliding_window": 6}),
                                           ("qwen2", {})])
def test_tp2_engine_equals_one_device_for_other_families(family, extra, tmp_path):
    """Qwen3's per-head q/k norms (replicated), Mistral's window (rank-local attention), Qwen2's q/k/v
    biases (split): two ranks give the one-device tokens."""
    base = make_base(tmp_path / "base", family, seed=31, heads=4, kv_heads=2, intermediate=96, **extra)
    adapters = {"a": write_random_adapter(tmp_path / "a", base, rank=4, targets=ALL, seed=5),
                "b": write_random_adapter(tmp_path / "b", base, rank=2, targets=["k_proj", "down_proj"], seed=6)}
    requests = _requests(adapters, 9, seed=8)
    outputs = []
    for tp in (1, 2):
        engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                     tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=16,
                                     page_size=4, max_model_len=64))
        try:
            outputs.append(generate(engine, requests, timeout=120))
        finally:
            engine.shutdown()
    for req, a, b in zip(requests, *outputs, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert b.token_ids == a.token_ids, f"{family} {req.request_id}: tp=2 != tp=1"

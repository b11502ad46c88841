"""The engine against transformers + peft, float32 on CPU: greedy output equal token for token."""

from __future__ import annotations

import random

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import assert_pool_drained, make_adapter, make_base, peft_greedy

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapters(base, root):
    return {
        "r2_qv": make_adapter(base, root / "r2_qv", rank=2, targets=["q_proj", "v_proj"], seed=11),
        "r8_all": make_adapter(base, root / "r8_all", rank=8, targets=ALL, seed=12),
        "r4_mlp_rs": make_adapter(base, root / "r4_mlp_rs", rank=4, targets=["gate_proj", "up_proj", "down_proj"],
                                  use_rslora=True, seed=13),
        "r16_layer1": make_adapter(base, root / "r16_layer1", rank=16, alpha=7, targets=["k_proj", "o_proj"],
                                   layers=[1], seed=14),
    }


FAMILY_CASES = {
    "llama": {},
    "llama3_rope_sharded": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "mistral_window": {"sliding_window": 6},
    "qwen2": {},
    "qwen3": {"head_dim": 24},
}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def checkpoint(request, tmp_path_factory):
    case = request.param
    family = case.split("_")[0].replace("llama3", "llama")
    root = tmp_path_factory.mktemp(case)
    shards = 3 if "sharded" in case else 1
    base = make_base(root / "base", family, shards=shards, seed=len(case), **FAMILY_CASES[case])
    return case, base, _adapters(base, root)


def _random_prompts(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[0] + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def _run_random_requests_against_peft(engine: Engine, base, adapters: dict, rng: random.Random, n: int,
                                      max_tokens: int) -> None:
    """n random prompts, each with an adapter drawn from the catalogue or none, through the engine at
    once: every output equals PEFT's greedy tokens."""
    names = [None, *adapters]
    cases = [(p, rng.choice(names)) for p in _random_prompts(n, engine.model_config.vocab_size, rng)]
    reqs = [GenerationRequest(f"r{i}", p, a, SamplingParams(max_tokens=max_tokens)) for i, (p, a) in enumerate(cases)]
    for (prompt, adapter), res in zip(cases, generate(engine, reqs), strict=True):
        assert res.error is None, res.error
        assert res.token_ids == peft_greedy(base, adapters.get(adapter), prompt, max_tokens), f"adapter={adapter}"


def test_mixed_batch_matches_peft(checkpoint):
    case, base, adapters = checkpoint
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 max_num_batched_tokens=48 if "sharded" in case else 4096))
    try:
        rng = random.Random(case)
        names = [None, *adapters]
        prompts = _random_prompts(10, engine.model_config.vocab_size, rng)
        cases = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
        reqs = [GenerationRequest(f"r{i}", p, a, SamplingParams(max_tokens=10), stream=i % 2 == 0)
                for i, (p, a) in enumerate(cases)]
        results = generate(engine, reqs)
        for (prompt, adapter), res in zip(cases, results, strict=True):
            expected = peft_greedy(base, adapters.get(adapter), prompt, 10)
            assert res.error is None
            assert res.token_ids == expected, f"{case} adapter={adapter} prompt={prompt}"
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_small_pool")
    base = make_base(root / "base", "llama", seed=5)
    return base, _adapters(base, root)


def test_preemption_and_chunked_prefill_keep_outputs_exact(llama):
    """A pool too small for all requests at once: preemption + recompute still give PEFT's tokens."""
    base, adapters = llama
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 page_size=4, num_kv_pages=56, max_num_batched_tokens=16, max_loras=2),
                    start=False)  # generate() starts it once every request is queued: all compete at once
    try:
        for name in adapters:  # in host memory before the requests come: all are admitted at once,
            engine.adapters.host.wait(engine.catalogue.get(name), timeout=60)  # however slow the loaders
        _run_random_requests_against_peft(engine, base, adapters, random.Random(7), 12, 20)
        assert engine.scheduler.num_preemptions > 0, "the test meant to force preemption"
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


def test_admitting_every_few_steps_keeps_outputs_exact(llama):
    """admit_every_steps defers new requests while others decode; outputs and completion are unchanged."""
    base, adapters = llama
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 admit_every_steps=4, max_num_seqs=4))
    try:
        _run_random_requests_against_peft(engine, base, adapters, random.Random(11), 10, 9)
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


def test_seeded_sampling_is_independent_of_batch(llama):
    base, adapters = llama
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()}))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234)
        alone = generate(engine, [GenerationRequest("a", [0, 5, 6, 7], "r8_all", params)])[0].token_ids
        crowd = [GenerationRequest(f"c{i}", [0, 9 + i], "r2_qv", SamplingParams(max_tokens=8, temperature=1.0))
                 for i in range(5)]
        together = generate(engine, [*crowd, GenerationRequest("b", [0, 5, 6, 7], "r8_all", params)])[-1].token_ids
        assert alone == together
        seeds = {tuple(generate(engine, [GenerationRequest(f"x{s}", [0, 5, 6, 7], None,
                                                          SamplingParams(max_tokens=12, temperature=1.5, seed=s))
                                         ])[0].token_ids) for s in range(6)}
        assert len(seeds) > 1, "different seeds always gave the same tokens"
    finally:
        engine.shutdown()

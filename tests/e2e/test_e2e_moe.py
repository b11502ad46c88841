"""MoE bases (Qwen3-MoE, Mixtral) with expert adapters, through the real server, against transformers+peft."""

from __future__ import annotations

import json
import random

import pytest

from model_factory import make_moe_adapter, make_moe_base, peft_greedy

pytestmark = pytest.mark.e2e

CASES = {
    "mixtral": dict(family="mixtral", layers=2, seed=13),
    "qwen3_moe": dict(family="qwen3_moe", layers=3, seed=14, head_dim=24, norm_topk_prob=False, mlp_only_layers=[1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_through_the_server_matches_peft(case, tmp_path, make_server):
    kwargs = dict(CASES[case])
    family = kwargs.pop("family")
    root = tmp_path / "model"
    base = make_moe_base(root / "base", family, **kwargs)
    adapters = {
        "attn": make_moe_adapter(base, root / "attn", rank=4, targets=["q_proj", "v_proj", "o_proj"], seed=31),
        "experts": make_moe_adapter(base, root / "experts", rank=4, targets=["k_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                    seed=32, init_std=0.6),
    }
    (root / "catalogue.json").write_text(json.dumps({k: str(v) for k, v in adapters.items()}))
    rng = random.Random(case)
    cases = [([1] + [rng.randrange(3, 290) for _ in range(rng.randint(2, 10))], name)
             for name in (None, "attn", "experts") for _ in range(2)]
    srv = make_server(root, tmp_path / "server")
    try:
        client = srv.client()
        # One at a time: mixed MoE batches are checked in the engine (tests/test_moe_oracle.py). Concurrent
        # requests right after this server started crashed tritonserver 2.51 inside libtriton_python.so
        # (std::bad_alloc, SIGSEGV) in 3 of about 12 runs; the cause is not established.
        got = [client.generate_ids(prompt, adapter=adapter, max_tokens=8) for prompt, adapter in cases]
    finally:
        srv.stop()
    eos = json.loads((base / "config.json").read_text()).get("eos_token_id")
    for (prompt, adapter), tokens in zip(cases, got, strict=True):
        expected = peft_greedy(base, adapters.get(adapter), prompt, 8, eos_id=eos)
        assert tokens == expected, f"{case} adapter={adapter} prompt={prompt}"

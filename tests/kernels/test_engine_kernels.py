"""The engine on its kernel path (LoRA shrink/expand, paged decode attention) against PEFT.

Runs the Triton kernels under the interpreter on the CPU (see conftest.py), compiled on a GPU
with TRITON_INTERPRET=0.
"""

from __future__ import annotations

import random

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import (
    assert_generations_match_peft,
    assert_pool_drained,
    make_base,
    peft_greedy,
    write_random_adapter,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family, prefill_attention, fused, decode_lora", [
    ("llama", "sdpa", True, "bgmv"), ("qwen3", "sdpa", True, "bgmv"), ("llama", "paged", True, "bgmv"),
    ("mistral", "paged", True, "bgmv"), ("qwen3", "sdpa", False, "bgmv"), ("llama", "sdpa", True, "sgmv"),
    ("llama", "paged", True, "hybrid")])
def test_kernel_path_matches_peft(tmp_path, device, family, prefill_attention, fused, decode_lora):
    """Mixed adapters/ranks/base requests; prefill chunks through torch's attention or as rows of the
    paged kernel (Mistral: its sliding window sends tokens past the window back to torch); residual
    add + RMSNorm, silu(gate) * up and the q/k norm + RoPE + KV write fused or as torch ops; small (decode)
    steps' LoRA one program per token (bgmv), grouped by adapter (sgmv), or the first for the shrink and the
    second for the expand (hybrid)."""
    extra = {"qwen3": {"head_dim": 24}, "mistral": {"sliding_window": 10}}.get(family, {})
    base = make_base(tmp_path / "base", family, seed=31, **extra)
    rng = random.Random(family)
    adapters = {}
    for i, rank in enumerate([1, 4, 8, 16]):
        adapters[f"a{i}"] = str(write_random_adapter(tmp_path / f"a{i}", base, rank=rank,
                                                     targets=rng.sample(ALL, rng.randint(1, 7)), seed=40 + i))
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, prefill_attention=prefill_attention,
                                 fuse_add_norm=fused, fuse_silu_mul=fused, fuse_rope_kv=fused,
                                 decode_lora_kernels=decode_lora))
    assert engine.model.fuse_add_norm is fused and engine.model.fuse_silu_mul is fused
    assert engine.model.fuse_rope_kv is fused
    assert engine.steps.decode_form == decode_lora
    try:
        names = [None, *adapters]
        cases = []
        for i in range(8):
            # one long prompt makes a prefill step of >= 64 tokens: the segmented (SGMV) kernels
            length = 70 if i == 0 else rng.randint(1, 12)
            cases.append(([0] + [rng.randrange(2, 290) for _ in range(length)], names[i % len(names)]))
        assert_generations_match_peft(engine, base, adapters, cases, 5, "k")
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_deferred_expand_matches_peft(tmp_path, device, family, monkeypatch):
    """Every expand of the small steps deferred (as captured decode steps defer them, here forced in eager steps):
    q/k/v's LoRA term added by the RoPE + KV write kernel (Qwen3: before its q/k norm), o_proj's and down_proj's by
    the residual add + RMSNorm, gate/up's by silu * up; mixed adapters, ranks and base-only rows, against PEFT."""
    from manylora.engine.layers.lora_batch import LoraBatch

    deferred: list[tuple[int, ...]] = []
    expand_deferred = LoraBatch.expand_deferred

    def counted(self, pending, widths):
        deferred.append(widths)
        return expand_deferred(self, pending, widths)

    monkeypatch.setattr(LoraBatch, "defer_expand", True)
    monkeypatch.setattr(LoraBatch, "expand_deferred", counted)
    extra = {"qwen3": {"head_dim": 24}}.get(family, {})
    base = make_base(tmp_path / "base", family, seed=37, **extra)
    rng = random.Random(family + "defer")
    adapters = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", base, rank=rank,
                                                  targets=rng.sample(ALL, rng.randint(3, 7)), seed=60 + i))
                for i, rank in enumerate([2, 8, 16])}
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, cuda_graphs=False))
    try:
        names = [None, *adapters]
        cases = [([0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 12))], names[i % len(names)])
                 for i in range(6)]
        assert_generations_match_peft(engine, base, adapters, cases, 6, "d")
        assert_pool_drained(engine)
    finally:
        engine.shutdown()
    cfg = engine.model.cfg
    qkv = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    widths = {qkv, (cfg.hidden_size,), (cfg.intermediate_size,) * 2}
    assert set(deferred) == widths, "every projection's expand must have been deferred"


def _count_skinny_gemm_rows(monkeypatch) -> list[int]:
    """The rows of every split-K base GEMM launched from now on (the kernel itself still runs)."""
    import manylora.kernels.skinny_gemm as skinny_gemm

    rows_seen: list[int] = []
    launch = skinny_gemm.skinny_linear

    def counted(x, weight, bias=None, config=None):
        rows_seen.append(x.shape[0])
        return launch(x, weight, bias, config)

    monkeypatch.setattr(skinny_gemm, "skinny_linear", counted)
    return rows_seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_triton_base_gemm_matches_peft(tmp_path, device, family, monkeypatch):
    """base_gemm "triton": the base layers' GEMMs and the LM head of steps up to 128 tokens through the split-K
    kernel (Qwen2: with the q/k/v bias in its epilogue), prefill steps above that through F.linear; on CUDA the
    decode steps are captured in graphs, so the kernel's workspace and counters live across replays."""
    rows_seen = _count_skinny_gemm_rows(monkeypatch)
    base = make_base(tmp_path / "base", family, seed=35)
    rng = random.Random(family + "gemm")
    adapters = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", base, rank=rank,
                                                  targets=rng.sample(ALL, rng.randint(1, 7)), seed=50 + i))
                for i, rank in enumerate([2, 8, 16])}
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, base_gemm="triton",
                                 max_num_batched_tokens=256))
    assert engine.model.base_gemm == "triton"
    try:
        names = [None, *adapters]
        # one 140-token prompt: a prefill step over the 128 rows the kernel takes, which F.linear serves
        cases = [([0] + [rng.randrange(2, 290) for _ in range(140 if i == 0 else rng.randint(1, 12))],
                  names[i % len(names)]) for i in range(7)]
        assert_generations_match_peft(engine, base, adapters, cases, 6, "g")
        assert_pool_drained(engine)
    finally:
        engine.shutdown()
    # the decode steps (one row per running request, 7 at most) took the kernel
    assert any(rows <= len(cases) for rows in rows_seen), rows_seen


def test_auto_base_gemm_matches_peft(tmp_path, device, monkeypatch):
    """base_gemm "auto": the split-K kernel only in CUDA-graph steps with adapters (their warm-ups included, which
    make its workspaces outside the capture), each shrink captured after its GEMM; eager steps (all of them on the
    CPU) and base-only graphs keep F.linear. Generations equal PEFT's either way."""
    from manylora.engine.models.llama import AUTO_TRITON_MAX_ROWS

    rows_seen = _count_skinny_gemm_rows(monkeypatch)
    base = make_base(tmp_path / "base", "llama", seed=36)
    rng = random.Random("auto-gemm")
    adapters = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", base, rank=rank,
                                                  targets=rng.sample(ALL, rng.randint(2, 7)), seed=70 + i))
                for i, rank in enumerate([4, 16])}
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, base_gemm="auto"))
    try:
        names = [None, *adapters]
        cases = [([0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 12))], names[i % len(names)])
                 for i in range(5)]
        assert_generations_match_peft(engine, base, adapters, cases, 6, "u")
        assert_pool_drained(engine)
    finally:
        engine.shutdown()
    if device == "cpu":
        assert rows_seen == [], "no graphs on the CPU: every step keeps F.linear"
    else:
        assert rows_seen and max(rows_seen) <= AUTO_TRITON_MAX_ROWS, rows_seen


@pytest.mark.parametrize("decode_lora, gemm_blas, sm_carveout, group_carveouts", [
    ("bgmv", "cublaslt", 32, ""), ("bgmv", "cublas", 0, ""), ("sgmv", "cublaslt", 32, ""),
    ("hybrid", "cublaslt", 32, ""), ("bgmv", "cublaslt", 32, "qkv=64/gate_up=8")])  # fmt: skip
def test_cuda_graph_replay_equals_eager(tmp_path, device, decode_lora, gemm_blas, sm_carveout, group_carveouts):
    """Decode steps replayed from CUDA graphs give exactly the eager kernel path's tokens (GPU only); with "sgmv" and
    "hybrid" the graphs group the tokens by adapter on the device at every replay; with an SM carveout their base
    GEMMs leave SMs to the LoRA kernels and each shrink is captured after its GEMM
    (manylora/engine/layers/decode_gemms.py), per
    projection group where ``decode_gemm_group_carveouts`` says."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU (run with TRITON_INTERPRET=0)")
    base = make_base(tmp_path / "base", "llama", seed=33)
    adapters = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", base, rank=r, targets=ALL, seed=i))
                for i, r in enumerate([2, 8, 16])}
    rng = random.Random(5)
    cases = [([0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 12))], [None, *adapters][i % 4])
             for i in range(12)]
    outputs = []
    for graphs in (False, True):
        engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                     kernels="triton", cuda_graphs=graphs, max_lora_rank=16, max_num_seqs=16,
                                     num_kv_pages=256, decode_lora_kernels=decode_lora,
                                     decode_gemm_blas=gemm_blas, decode_gemm_sm_carveout=sm_carveout,
                                     decode_gemm_group_carveouts=group_carveouts))
        try:
            assert (engine.graphs is not None) is graphs
            reqs = [GenerationRequest(f"g{i}", p, a, SamplingParams(max_tokens=12)) for i, (p, a) in enumerate(cases)]
            outputs.append([r.token_ids for r in generate(engine, reqs)])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_moe_cuda_graph_replay_equals_eager(tmp_path, device):
    """An MoE base: decode steps replayed from CUDA graphs (experts and their LoRA through the fused kernels, in
    graph mode) give the eager kernel path's tokens; an adapter the fused kernel cannot express (gate_up rank 2r)
    is served by eager steps. GPU only."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU (run with TRITON_INTERPRET=0)")
    from model_factory import make_moe_adapter, make_moe_base

    base = make_moe_base(tmp_path / "base", "qwen3_moe", seed=61, head_dim=24)
    adapters = {
        "experts": make_moe_adapter(base, tmp_path / "experts", rank=4, targets=["q_proj", "v_proj"],
                                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                    seed=62, init_std=0.6),
        "attn": make_moe_adapter(base, tmp_path / "attn", rank=2, targets=["o_proj"], seed=63),
        "renamed": make_moe_adapter(base, tmp_path / "renamed", rank=2, targets=["gate_proj", "up_proj", "down_proj"],
                                    seed=64, init_std=0.6),
    }
    rng = random.Random(7)
    names = [None, "experts", "attn"]
    cases = [([1] + [rng.randrange(3, 290) for _ in range(rng.randint(2, 9))], names[i % 3]) for i in range(9)]
    cases += [([1, 7, 31], "experts")]
    # the inexpressible adapter in a round of its own: in a batch with the others it would send every step eager
    rounds = [cases, [([1, 5, 9, 200], "renamed"), ([1, 7, 31], "experts")]]
    outputs = []
    for graphs in (False, True):
        engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                     device=device, dtype="float32", kernels="triton", cuda_graphs=graphs,
                                     max_lora_rank=8, max_num_seqs=16, page_size=8))
        try:
            assert (engine.graphs is not None) is graphs
            tokens = []
            for k, round_cases in enumerate(rounds):
                reqs = [GenerationRequest(f"g{k}.{i}", p, a, SamplingParams(max_tokens=8))
                        for i, (p, a) in enumerate(round_cases)]
                results = generate(engine, reqs, timeout=900)
                assert all(r.error is None for r in results), [r.error for r in results]
                tokens += [r.token_ids for r in results]
                if graphs and k == 0:  # the first round's decode steps were replayed, its adapters' with LoRA
                    assert engine.graphs.replays[True] >= 5, engine.graphs.replays
            outputs.append(tokens)
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_warm_up_runs_the_kernel_path_and_gives_every_page_back(tmp_path, device):
    from manylora.engine.execution.warmup import step_sizes, warm_up

    # one layer: what warm-up uses and gives back does not depend on the depth
    base = make_base(tmp_path / "base", "llama", layers=1, seed=35)
    engine = Engine(EngineConfig(model_dir=str(base), device=device, dtype="float32", kernels="triton",
                                 max_lora_rank=8, page_size=8, cuda_graphs=False, warmup=False, max_model_len=64),
                    start=False)
    try:
        before = engine.pool.usage()
        # 130 tokens: more than the context (max_num_batched_tokens may exceed max_model_len), so several sequences
        assert warm_up(engine.model, engine.kv, 8, max_tokens=130, max_seqs=4, sizes=[1, 3, 63, 64, 130],
                       max_len=engine.max_len) > 0
        assert warm_up(engine.model, engine.kv, 8, max_tokens=130, max_seqs=4, sizes=[5, 64, 130],
                       max_len=engine.max_len, paged_prefill=True) > 0
        for form, sizes in (("sgmv", [2, 17]), ("hybrid", [3])):
            assert warm_up(engine.model, engine.kv, 8, max_tokens=130, max_seqs=4, sizes=sizes,
                           max_len=engine.max_len, decode_form=form) > 0
        assert engine.pool.usage() == before
        engine.pool.pages.check()
        assert step_sizes(4096)[:16] == list(range(1, 17)) and step_sizes(4096)[-1] == 4096
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_kernel_path_matches_peft(tmp_path, device, family, monkeypatch):
    """Experts and their LoRA through the fused MoE-LoRA kernels inside the engine, against PEFT."""
    import manylora.kernels.fused_moe_lora as fused
    from model_factory import make_moe_adapter, make_moe_base

    calls = {"with_lora": 0, "without": 0}
    real = fused.fused_moe_lora_forward

    def counting(*args, **kwargs):
        calls["with_lora" if args[5] is not None else "without"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "fused_moe_lora_forward", counting)

    extra = {"head_dim": 24, "norm_topk_prob": False, "mlp_only_layers": [1]} if family == "qwen3_moe" else {}
    base = make_moe_base(tmp_path / "base", family, layers=3 if extra else 2, seed=51, **extra)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapters = {
        "experts": make_moe_adapter(base, tmp_path / "experts", rank=4, targets=["q_proj", "v_proj"],
                                    target_parameters=experts, seed=52, init_std=0.6),
        "attn": make_moe_adapter(base, tmp_path / "attn", rank=2, targets=["o_proj"], seed=53),
        # gate_up rank 2r vs down rank r: the kernels cannot express it, the torch loop serves it
        "renamed": make_moe_adapter(base, tmp_path / "renamed", rank=2,
                                    targets=["w1", "w2", "w3"] if family == "mixtral" else
                                    ["gate_proj", "up_proj", "down_proj"], seed=54, init_std=0.6),
    }
    # eager steps: the kernels against PEFT (decode graphs on an MoE base: test_moe_cuda_graph_replay_equals_eager)
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 device=device, dtype="float32", kernels="triton", max_lora_rank=8, page_size=8,
                                 cuda_graphs=False))
    try:
        assert engine.model.use_kernels
        rng = random.Random(family)
        cases, results = [], []
        # first batches the kernels can express, then one with the renamed adapter (torch loop)
        for group in ([None, "experts", "attn"], ["renamed", None]):
            batch = [([1] + [rng.randrange(3, 290) for _ in range(rng.randint(2, 9))], group[i % len(group)])
                     for i in range(2 * len(group))]
            reqs = [GenerationRequest(f"m{len(cases) + i}", p, a, SamplingParams(max_tokens=6))
                    for i, (p, a) in enumerate(batch)]
            cases += batch
            results += generate(engine, reqs, timeout=900)
        eos = engine.model_config.eos_token_ids[0] if engine.model_config.eos_token_ids else None
        for (prompt, adapter), res in zip(cases, results, strict=True):
            assert res.error is None, res.error
            expected = peft_greedy(base, adapters[adapter] if adapter else None, prompt, 6, eos_id=eos)
            assert res.token_ids == expected, f"{family} adapter={adapter}"
        assert calls["with_lora"] > 0 and calls["without"] > 0, calls
    finally:
        engine.shutdown()

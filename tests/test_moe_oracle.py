"""MoE bases (Mixtral, Qwen3-MoE) with LoRA on attention and on the experts, against transformers + peft.

Float32 on CPU, greedy: the engine's tokens equal PEFT's token for token, in mixed batches with the base.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from manylora.engine.adapters.spec import parse_adapter_spec
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.config import EngineConfig
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import ModelConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import assert_pool_drained, make_moe_adapter, make_moe_base, peft_greedy

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

CASES = {
    # Mixtral: softmax over experts, top-2, always renormalised.
    "mixtral": dict(family="mixtral", layers=2, seed=3),
    # Qwen3-MoE: q/k norms, top-2 not renormalised, layer 1 dense (mlp_only_layers).
    "qwen3_moe": dict(family="qwen3_moe", layers=3, seed=4, head_dim=24, norm_topk_prob=False,
                      mlp_only_layers=[1]),
}


def _adapters(base, root, family):
    # PEFT converts transformers-4 expert names to target_parameters on the fused experts (gate_up rank 2r).
    v4_names = ["w1", "w2", "w3"] if family == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    return {
        "attn": make_moe_adapter(base, root / "attn", rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 seed=21),
        "experts": make_moe_adapter(base, root / "experts", rank=4, targets=["q_proj", "v_proj"],
                                    target_parameters=EXPERTS, seed=22, init_std=0.6),
        "down_only": make_moe_adapter(base, root / "down_only", rank=8, alpha=5,
                                      target_parameters=["experts.down_proj"], seed=23, init_std=0.6),
        "v4_names": make_moe_adapter(base, root / "v4_names", rank=2, targets=["o_proj", *v4_names], seed=24,
                                     init_std=0.6),
    }


@pytest.fixture(scope="module", params=list(CASES))
def moe_checkpoint(request, tmp_path_factory):
    case = request.param
    kwargs = dict(CASES[case])
    family = kwargs.pop("family")
    root = tmp_path_factory.mktemp(case)
    base = make_moe_base(root / "base", family, **kwargs)
    return case, family, base, _adapters(base, root, family)


def test_config_reads_moe_fields(moe_checkpoint):
    case, family, base, _ = moe_checkpoint
    cfg = ModelConfig.from_dir(base)
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.moe_intermediate_size == 32
    if family == "mixtral":
        assert cfg.norm_topk_prob and cfg.sparse_layers == (0, 1)
    else:
        assert not cfg.norm_topk_prob and cfg.sparse_layers == (0, 2) and cfg.intermediate_size == 48


def test_expert_adapter_layout(moe_checkpoint):
    """PEFT's fused-expert factors, as loaded: W_e + s * B_e @ A_e equals PEFT's own delta weight."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    case, family, base, adapters = moe_checkpoint
    cfg = ModelConfig.from_dir(base)
    spec = parse_adapter_spec("v4_names", adapters["v4_names"], cfg, max_lora_rank=16)
    assert spec.expert_ranks[(0, "gate_up_proj")] == 4 and spec.expert_ranks[(0, "down_proj")] == 2
    assert spec.expert_scaling[(0, "gate_up_proj")] == spec.expert_scaling[(0, "down_proj")] == 2.0
    weights = load_adapter_weights(spec, cfg)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapters["v4_names"])
    outer = model.base_model.model.model.layers[0].mlp.experts  # ParamWrapper(down_proj) over ParamWrapper(gate_up)
    for wrapper, parameter in ((outer, "down_proj"), (outer.base_layer, "gate_up_proj")):
        assert wrapper.parameter_name == parameter
        a, b, s = weights.expert_weights[(0, parameter)]
        torch.testing.assert_close(s * b @ a, wrapper.get_delta_weight("default"))


def test_mixed_batch_matches_peft(moe_checkpoint):
    case, family, base, adapters = moe_checkpoint
    engine = Engine(EngineConfig(model_dir=str(base), adapters={k: str(v) for k, v in adapters.items()},
                                 max_num_batched_tokens=40))
    try:
        rng = random.Random(case)
        names = [None, *adapters]
        vocab = engine.model_config.vocab_size
        prompts = [[0] + [rng.randrange(2, vocab) for _ in range(rng.randint(1, 16))] for _ in range(2 * len(names))]
        cases = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
        reqs = [GenerationRequest(f"r{i}", p, a, SamplingParams(max_tokens=8), stream=i % 2 == 0)
                for i, (p, a) in enumerate(cases)]
        results = generate(engine, reqs)
        for (prompt, adapter), res in zip(cases, results, strict=True):
            assert res.error is None, res.error
            assert res.token_ids == peft_greedy(base, adapters.get(adapter), prompt, 8), \
                f"{case} adapter={adapter} prompt={prompt}"
        assert_pool_drained(engine)
    finally:
        engine.shutdown()


def _per_expert_adapter(out, targets):
    """The transformers-4 layout: one LoRA module per expert."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    key = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    save_file({f"{key}.lora_A.weight": torch.zeros(2, 64), f"{key}.lora_B.weight": torch.zeros(32, 2)},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": targets, "bias": "none"}))
    return out


def test_unsupported_layouts_are_refused(moe_checkpoint, tmp_path):
    case, family, base, adapters = moe_checkpoint
    cfg = ModelConfig.from_dir(base)
    with pytest.raises(AdapterError, match="target module 'w1' is not supported"):
        parse_adapter_spec("per_expert", _per_expert_adapter(tmp_path / "pe1", ["w1"]), cfg, max_lora_rank=16)
    with pytest.raises(AdapterError, match="one LoRA module per expert"):
        parse_adapter_spec("per_expert", _per_expert_adapter(tmp_path / "pe2", ".*w1"), cfg, max_lora_rank=16)
    # "all-linear" on an MoE base also adapts the router (target_parameters gate.weight): refused.
    router = make_moe_adapter(base, tmp_path / "router", rank=2, targets="all-linear", seed=5)
    with pytest.raises(AdapterError, match="gate.weight"):
        parse_adapter_spec("router", router, cfg, max_lora_rank=16)
    # Expert LoRA on a dense base: refused.
    dense = ModelConfig.from_dict({**json.loads((base / "config.json").read_text()),
                                   "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 48})
    with pytest.raises(AdapterError, match="target_parameters"):
        parse_adapter_spec("experts", adapters["experts"], dense, max_lora_rank=16)


def test_fused_expert_checkpoint_loads(moe_checkpoint, tmp_path):
    """The fused layout (mlp.gate, mlp.experts.gate_up_proj / down_proj) gives the per-expert layout's tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    case, family, base, adapters = moe_checkpoint
    cfg = ModelConfig.from_dir(base)
    fused_dir = tmp_path / "fused"
    shutil.copytree(base, fused_dir)
    tensors = load_file(str(base / "model.safetensors"))
    names = {"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral" else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    for i in cfg.sparse_layers:
        src, dst = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
        experts = [{k: tensors.pop(f"{src}experts.{e}.{v}.weight") for k, v in names.items()}
                   for e in range(cfg.num_experts)]
        tensors[dst + "gate.weight"] = tensors.pop(src + "gate.weight")
        tensors[dst + "experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in experts])
        tensors[dst + "experts.down_proj"] = torch.stack([x["down"] for x in experts])
    save_file(tensors, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[0, 5, 9, 17, 33], [0, 44, 2, 91]]
    outputs = []
    for model_dir in (base, fused_dir):
        engine = Engine(EngineConfig(model_dir=str(model_dir), adapters={"experts": str(adapters["experts"])}))
        try:
            reqs = [GenerationRequest(f"r{i}{a}", p, a, SamplingParams(max_tokens=6))
                    for i, p in enumerate(prompts) for a in (None, "experts")]
            outputs.append([r.token_ids for r in generate(engine, reqs)])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
    assert outputs[0][:2] == [peft_greedy(base, a, prompts[0], 6) for a in (None, adapters["experts"])]


def test_sizing_counts_experts(moe_checkpoint, tmp_path):
    """The planner's weight bytes and adapter pages equal what the engine holds for an MoE base."""
    from manylora.engine.memory.sizing import adapter_pages, weight_bytes
    from manylora.engine.model_config import ATTENTION_PROJECTIONS

    case, family, base, _ = moe_checkpoint
    adapter = make_moe_adapter(base, tmp_path / "a", rank=4, targets=list(ATTENTION_PROJECTIONS),
                               target_parameters=EXPERTS, seed=40)
    engine = Engine(EngineConfig(model_dir=str(base), adapters={"a": str(adapter)}, page_size=8))
    try:
        cfg = engine.model_config
        assert weight_bytes(cfg, torch.float32) == engine.model.weight_bytes()
        res = generate(engine, [GenerationRequest("s", [1, 5, 6], "a", SamplingParams(max_tokens=2))])[0]
        assert res.error is None
        assert engine.pool.usage()["adapters"] == adapter_pages(cfg, 4, 8, ATTENTION_PROJECTIONS)
    finally:
        engine.shutdown()

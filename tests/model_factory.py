"""Tiny random checkpoints and PEFT adapters, written through the same code paths a user's go through."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Café crème, naïve façade, 東京 and emoji 🙂 too. "
    "Rain falls on the small town while the baker opens the shop and the river runs by the old mill. "
) * 8

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def train_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE with <s>/</s>, <s> prepended to every sequence."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def make_base(out: Path, family: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
              kv_heads: int = 2, intermediate: int = 96, seed: int = 0, shards: int = 1,
              dtype: torch.dtype = torch.float32, **extra) -> Path:
    """Write a random-weight checkpoint of a family with a trained tokenizer; returns its directory."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    arch = FAMILIES[family]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        architectures=[arch], **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the default init: peakier logits
            p.normal_(0, 0.15)
    max_shard = "1GB" if shards == 1 else f"{max(1, _param_bytes(model) // shards // 1000)}KB"
    model.save_pretrained(out, max_shard_size=max_shard)
    return out


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _save_random_lora(peft_model, out: Path, std: float, seed: int) -> None:
    """Draw every LoRA parameter of a PEFT model from N(0, std) (nonzero A and B) and save the adapter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    peft_model.save_pretrained(out)


def make_adapter(base_dir: Path, out: Path, *, rank: int, targets: list[str], alpha: float | None = None,
                 seed: int = 1, use_rslora: bool = False, layers: list[int] | None = None) -> Path:
    """A PEFT LoRA adapter for base_dir with random (nonzero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, use_rslora=use_rslora,
                        layers_to_transform=layers, task_type="CAUSAL_LM")
    _save_random_lora(get_peft_model(model, config), out, 0.3 / rank ** 0.5, seed)
    return out


def write_catalogue(path: Path, adapters: dict[str, Path]) -> Path:
    path.write_text(json.dumps({k: str(v) for k, v in adapters.items()}, indent=1))
    return path


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int,
                eos_id: int | None = 1) -> list[int]:
    """The oracle: transformers (+ peft) greedy continuation, float32 on CPU, stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=eos_id)
    new = out[0, len(prompt_ids):].tolist()
    if eos_id is not None and eos_id in new:
        new = new[: new.index(eos_id)]
    return new


def assert_generations_match_peft(engine, base_dir: Path, adapters: dict[str, str],
                                  cases: list[tuple[list[int], str | None]], max_tokens: int, prefix: str) -> None:
    """Generate every (prompt ids, adapter name or None) case greedily through the engine at once (requests
    ``prefix``0, 1, ...) and check each against the PEFT oracle."""
    from manylora.engine.requests.types import GenerationRequest, SamplingParams
    from manylora.engine.scheduling.offline import generate

    reqs = [GenerationRequest(f"{prefix}{i}", p, a, SamplingParams(max_tokens=max_tokens))
            for i, (p, a) in enumerate(cases)]
    results = generate(engine, reqs, timeout=900)
    for (prompt, adapter), res in zip(cases, results, strict=True):
        assert res.error is None, res.error
        expected = peft_greedy(base_dir, adapters[adapter] if adapter else None, prompt, max_tokens)
        assert res.token_ids == expected, f"adapter={adapter} prompt length {len(prompt)}"


def assert_pool_drained(engine) -> None:
    """No KV page left behind, page bookkeeping consistent, every idle adapter evictable."""
    pool = engine.pool
    pool.pages.check()
    assert pool.usage()["kv"] == 0, pool.usage()
    reserved = pool.usage()["reserved"]  # the CUDA-graph padding page, on a GPU
    assert engine.adapters.make_room(pool.num_pages - reserved, pinned=set())
    assert pool.pages.num_free == pool.num_pages - reserved


def write_random_adapter(out: Path, base_dir: Path, *, rank: int, targets: list[str], seed: int,
                         alpha: float | None = None) -> Path:
    """A PEFT-format LoRA adapter written directly (fast, for catalogues of thousands)."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
              "o_proj": (q_out, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in targets:
            n_in, n_out = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.3 / rank ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.3 / rank ** 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "base_model_name_or_path": str(base_dir), "inference_mode": True}))
    return out


MOE_FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def make_moe_base(out: Path, family: str = "mixtral", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                  kv_heads: int = 2, experts: int = 4, top_k: int = 2, expert_intermediate: int = 32,
                  intermediate: int = 48, seed: int = 0, **extra) -> Path:
    """A random-weight Mixtral or Qwen3-MoE checkpoint (as transformers' save_pretrained writes it) + tokenizer."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    arch = MOE_FAMILIES[family]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    if family == "mixtral":
        moe = {"num_local_experts": experts, "intermediate_size": expert_intermediate}
    else:
        moe = {"num_experts": experts, "moe_intermediate_size": expert_intermediate, "intermediate_size": intermediate}
    config = config_cls(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_experts_per_tok=top_k, max_position_embeddings=256, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False, architectures=[arch], **moe, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(out)
    return out


def make_moe_adapter(base_dir: Path, out: Path, *, rank: int, targets: list[str] | str | None = None,
                     target_parameters: list[str] | None = None, alpha: float | None = None, seed: int = 1,
                     init_std: float = 0.3) -> Path:
    """A PEFT LoRA adapter for an MoE base: target_modules and/or target_parameters (fused experts), random A/B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets if targets is not None else [],
                        target_parameters=target_parameters, task_type="CAUSAL_LM")
    _save_random_lora(get_peft_model(model, config), out, init_std / rank ** 0.5, seed)
    return out

"""Training for the embedded default model: a freshly initialised tiny Llama trained on the corpus, and PEFT LoRA
adapters trained on the base's copies (manylora/embedded/build.py decides what is built, from which seeds)."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from manylora.embedded.tokenizer import BOS, EOS, PAD

if TYPE_CHECKING:
    from manylora.embedded.build import AdapterSpec, ModelShape, TrainConfig


def make_base_model(shape: ModelShape, vocab_size: int, tok, seed: int):
    """A freshly initialised float32 LlamaForCausalLM of the given shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    return model


def _lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup then cosine decay to 10% of the peak learning rate."""

    def scale(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return scale


def train_lm(model, stream: torch.Tensor, cfg: TrainConfig, seed: int) -> float:
    """Next-token training on random fixed-length windows of ``stream``; returns the last loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(cfg))
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(cfg.seq_len)
    model.train()
    loss_value = float("nan")
    for _ in range(cfg.steps):
        starts = torch.randint(0, len(stream) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        batch = stream[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def train_adapter(base, spec: AdapterSpec, stream: torch.Tensor, cfg: TrainConfig, seed: int, out_dir: Path) -> float:
    """Wrap a copy of ``base`` with a LoRA adapter, train it on ``stream``, save it; returns the last loss."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=0.0,
        target_modules=list(spec.target_modules),
        use_rslora=spec.use_rslora,
        layers_to_transform=list(spec.layers_to_transform) if spec.layers_to_transform else None,
        bias="none",
    )
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), lora)
    loss = train_lm(model, stream, cfg, seed)
    _check_lora_b_nonzero(model, spec.name)
    model.save_pretrained(str(out_dir))
    _tidy_adapter_dir(out_dir)
    return loss


def _tidy_adapter_dir(adapter_dir: Path) -> None:
    """Drop PEFT's boilerplate model card and store target_modules sorted (PEFT writes a set)."""
    (adapter_dir / "README.md").unlink(missing_ok=True)
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_lora_b_nonzero(model, name: str) -> None:
    """PEFT initialises lora_B to zero; a trained adapter must have moved every one of them."""
    for key, tensor in model.state_dict().items():
        if "lora_B" in key and not bool(tensor.abs().sum() > 0):
            raise RuntimeError(f"adapter '{name}': {key} is still all zeros after training")

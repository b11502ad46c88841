"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Numerics follow Hugging Face's implementation: RMSNorm in float32, rotate-half RoPE,
grouped-query attention, SwiGLU MLP; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.kv_cache import PagedKVCache
from backend.loader import load_state_dict
from backend.lora_batch import LoraBatch
from backend.model_config import ModelConfig
from backend.rope import RotaryEmbedding
from backend.step_batch import StepBatch


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    proj: dict[str, torch.Tensor]  # q_proj .. down_proj: [out, in]
    bias: dict[str, torch.Tensor]  # present only where the checkpoint has biases
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def weight_names(cfg: ModelConfig) -> set[str]:
    """Every tensor name the model reads from a checkpoint."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.add(f"{p}self_attn.{m}.weight")
        for m in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"{p}mlp.{m}.weight")
        if cfg.qkv_bias:
            names |= {f"{p}self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")}
        if cfg.attention_bias:
            names.add(f"{p}self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names |= {f"{p}mlp.{m}.bias" for m in ("gate_proj", "up_proj", "down_proj")}
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


class LlamaModel:
    """Weights on one device and a forward pass over a flat batch of tokens."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], max_len: int, device: str,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.embed = tensors["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else tensors["lm_head.weight"]
        self.final_norm = tensors["model.norm.weight"]
        self.layers = [self._layer(tensors, i) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg, max_len, device, dtype)
        self.scale = cfg.head_dim ** -0.5

    @classmethod
    def load(cls, model_dir: str | Path, cfg: ModelConfig, max_len: int, device: str,
             dtype: torch.dtype) -> LlamaModel:
        tensors = load_state_dict(model_dir, weight_names(cfg), dtype, device)
        return cls(cfg, tensors, max_len, device, dtype)

    def _layer(self, t: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        proj, bias = {}, {}
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            prefix = f"{p}self_attn.{m}" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else f"{p}mlp.{m}"
            proj[m] = t[prefix + ".weight"]
            if prefix + ".bias" in t:
                bias[m] = t[prefix + ".bias"]
        return LayerWeights(
            input_norm=t[p + "input_layernorm.weight"],
            post_attention_norm=t[p + "post_attention_layernorm.weight"],
            proj=proj,
            bias=bias,
            q_norm=t.get(p + "self_attn.q_norm.weight"),
            k_norm=t.get(p + "self_attn.k_norm.weight"),
        )

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.embed, self.lm_head, self.final_norm]
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_attention_norm, *layer.proj.values(), *layer.bias.values()]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    # ------------------------------------------------------------------ forward
    def _linear(self, x: torch.Tensor, layer: int, module: str, lora: LoraBatch | None) -> torch.Tensor:
        w = self.layers[layer]
        out = F.linear(x, w.proj[module], w.bias.get(module))
        if lora is not None:
            lora.apply(x, out, layer, module)
        return out

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: PagedKVCache, lora: LoraBatch | None) -> torch.Tensor:
        """Run the step; returns float32 logits [len(batch.logits_rows), vocab]."""
        cfg = self.cfg
        h = self.embed[batch.input_ids]
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
            h = h + self._attention(x, i, w, batch, kv, lora)
            x = rms_norm(h, w.post_attention_norm, cfg.rms_norm_eps)
            gate = self._linear(x, i, "gate_proj", lora)
            up = self._linear(x, i, "up_proj", lora)
            h = h + self._linear(F.silu(gate) * up, i, "down_proj", lora)
        h = rms_norm(h.index_select(0, batch.logits_rows), self.final_norm, cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def _attention(self, x: torch.Tensor, i: int, w: LayerWeights, batch: StepBatch, kv: PagedKVCache,
                   lora: LoraBatch | None) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        q = self._linear(x, i, "q_proj", lora).view(T, cfg.num_heads, cfg.head_dim)
        k = self._linear(x, i, "k_proj", lora).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = self._linear(x, i, "v_proj", lora).view(T, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q = self.rope.apply(q, batch.positions)
        k = self.rope.apply(k, batch.positions)
        kv.write(i, batch.kv_slots, k, v)
        out = torch.empty_like(q)
        for seq in batch.sequences:
            out[seq.start:seq.start + seq.length] = self._sequence_attention(
                q[seq.start:seq.start + seq.length], batch.positions[seq.start:seq.start + seq.length],
                *kv.read(i, seq.block_table, seq.context_len))
        return self._linear(out.view(T, -1), i, "o_proj", lora)

    def _sequence_attention(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d] at positions q_pos over k, v [ctx, kv_heads, d]; causal (and windowed)."""
        k_pos = torch.arange(k.shape[0], device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if self.cfg.sliding_window:
            allowed &= k_pos[None, :] > q_pos[:, None] - self.cfg.sliding_window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
            scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1)

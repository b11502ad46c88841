"""Rotary position embeddings as Hugging Face's Llama family computes them."""

from __future__ import annotations

import math

import torch

from manylora.engine.model_config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq [head_dim // 2] in float32, with linear or llama3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are divided by factor, short ones kept, the middle smoothed.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for positions 0..max_len-1; apply() rotates q or k in place of HF's."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: str, dtype: torch.dtype) -> None:
        inv_freq = inverse_frequencies(cfg).to(device)
        positions = torch.arange(max_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)  # [max_len, head_dim]
        self.sin = emb.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for positions [T] (once per step, shared by all layers)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, heads, head_dim], positions [T] -> rotated x (rotate-half convention)."""
        cos, sin = table if table is not None else self.lookup(positions)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

"""The paged KV cache: one tensor of pages, each holding page_size tokens of every layer."""

from __future__ import annotations

import torch

from backend.model_config import ModelConfig
from backend.page_pool import PagePool


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: [layers, 2 (k, v), page_size, kv_heads, head_dim]."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem


class PagedKVCache:
    """KV storage [num_pages, layers, 2, page_size, kv_heads, head_dim] plus its page pool.

    A sequence owns a list of pages (its block table); token position t lives in page
    ``block_table[t // page_size]`` at slot ``t % page_size``.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str) -> None:
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        shape = (num_pages, cfg.num_layers, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at flat slots [T] (page * page_size + offset)."""
        pages = slots // self.page_size
        offsets = slots % self.page_size
        self.storage[pages, layer, 0, offsets] = k
        self.storage[pages, layer, 1, offsets] = v

    def read(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [length, kv_heads, head_dim] of one sequence, gathered from its pages."""
        pages = self.storage[block_table, layer]  # [n_blocks, 2, page_size, kv_heads, head_dim]
        k = pages[:, 0].reshape(-1, *pages.shape[-2:])[:length]
        v = pages[:, 1].reshape(-1, *pages.shape[-2:])[:length]
        return k, v

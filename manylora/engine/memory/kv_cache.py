"""The paged KV cache, in the unified pool: token t of a sequence lives in page
``block_table[t // page_size]`` at slot ``t % page_size``."""

from __future__ import annotations

import torch

from manylora.engine.memory.unified_pool import UnifiedPool


class PagedKVCache:
    """Reads and writes keys and values of sequences whose pages the pool hands out."""

    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.storage = pool.kv  # [num_pages, layers, 2, page_size, kv_heads, head_dim]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, offsets) of flat slots [T] (page * page_size + offset)."""
        return slots // self.page_size, slots % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              located: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store k, v [T, kv_heads, head_dim] at flat slots [T] (page * page_size + offset)."""
        pages, offsets = located if located is not None else self.locate(slots)
        self.storage[pages, layer, 0, offsets] = k
        self.storage[pages, layer, 1, offsets] = v

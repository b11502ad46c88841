"""S-LoRA's Unified Paging: one tensor of pages holds the KV cache and resident adapters.

A page is ``page_elems`` elements of the model dtype. Used as KV cache it holds, for every
layer, the keys and values of ``page_size`` tokens: [layers, 2, page_size, kv_heads, head_dim].
Used for an adapter it holds "rank rows": row k of a projection's A ([in] elements) or of
B transposed ([out] elements), packed so no row straddles two pages. No split between the
two uses is fixed: each page is free, a sequence's KV, or part of an adapter.
"""

from __future__ import annotations

import torch

from manylora.engine.memory.page_pool import PagePool
from manylora.engine.model_config import PROJECTIONS, ModelConfig


def page_elements(cfg: ModelConfig, page_size: int) -> int:
    return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    return page_elements(cfg, page_size) * element_size(dtype)


def longest_rank_row(cfg: ModelConfig) -> int:
    return max(max(cfg.projection_shape(m)) for m in PROJECTIONS)


class AdapterKey:
    """Page owner for a resident adapter version (identity, not equality, matters to the pool)."""

    def __init__(self, name: str, sha256: str) -> None:
        self.name = name
        self.sha256 = sha256

    def __repr__(self) -> str:
        return f"AdapterKey({self.name}@{self.sha256[:12]})"


class ReservedPage:
    """Page owner for pages the engine keeps for itself (CUDA-graph padding rows write there)."""

    def __init__(self, purpose: str) -> None:
        self.purpose = purpose

    def __repr__(self) -> str:
        return f"ReservedPage({self.purpose})"


class UnifiedPool:
    """The pages, their bookkeeping, and views of the storage for each use."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.page_elems = page_elements(cfg, page_size)
        longest = longest_rank_row(cfg)
        if longest > self.page_elems:
            raise ValueError(
                f"page_size {page_size} gives pages of {self.page_elems} elements, shorter than the longest "
                f"adapter row ({longest} elements); raise page_size to at least "
                f"{-(-longest // (self.page_elems // page_size))}")
        self.pages = PagePool(num_pages)
        self.storage = torch.zeros(num_pages * self.page_elems, dtype=dtype, device=device)
        self.kv = self.storage.view(num_pages, cfg.num_layers, 2, page_size, cfg.num_kv_heads, cfg.head_dim)

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def usage(self) -> dict[str, int]:
        """Pages held by sequences' KV, by adapters and by the engine itself, and free pages."""
        owners = self.pages.owners()
        adapter_pages = sum(len(self.pages.pages_of(o)) for o in owners if isinstance(o, AdapterKey))
        reserved = sum(len(self.pages.pages_of(o)) for o in owners if isinstance(o, ReservedPage))
        return {"kv": self.pages.num_used - adapter_pages - reserved, "adapters": adapter_pages,
                "reserved": reserved, "free": self.pages.num_free}

"""The GPU tier: adapters resident in the unified pool, least recently used out first.

An adapter used by a running request is pinned by the caller and never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from backend.adapter import AdapterSpec
from backend.adapter_packing import PackedAdapter
from backend.unified_pool import AdapterKey, UnifiedPool


@dataclass
class ResidentAdapter:
    key: AdapterKey
    spec: AdapterSpec
    row_offsets: torch.Tensor  # int64 [layers, 7, 2, max_rank]: absolute pool element offsets, -1 unused
    ranks: torch.Tensor  # int32 [layers, 7]
    scalings: torch.Tensor  # float32 [layers, 7]
    num_pages: int


class AdapterPool:
    def __init__(self, pool: UnifiedPool, device: str) -> None:
        self.pool = pool
        self.device = device
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()
        self.uploads = 0
        self.evictions = 0

    def get(self, spec: AdapterSpec) -> ResidentAdapter | None:
        entry = self._resident.get(spec.name)
        if entry is None or entry.spec.sha256 != spec.sha256:
            return None
        self._resident.move_to_end(spec.name)
        return entry

    def upload(self, packed: PackedAdapter) -> ResidentAdapter:
        """Copy a packed adapter into free pages (the caller made room)."""
        name = packed.spec.name
        if name in self._resident:
            self.evict(name)  # an older version
        key = AdapterKey(name, packed.spec.sha256)
        pages = self.pool.pages.allocate(key, packed.num_pages)
        page_ids = torch.tensor(pages, dtype=torch.int64)
        pe = self.pool.page_elems
        storage = self.pool.storage.view(self.pool.num_pages, pe)
        storage.index_copy_(0, page_ids.to(self.device), packed.data.to(self.device, non_blocking=True))
        rel = packed.row_offsets
        absolute = torch.where(rel >= 0, page_ids[rel.clamp(min=0) // pe] * pe + rel.clamp(min=0) % pe, rel)
        entry = ResidentAdapter(key, packed.spec, absolute.to(self.device), packed.ranks.to(self.device),
                                packed.scalings.to(self.device), packed.num_pages)
        self._resident[name] = entry
        self.uploads += 1
        return entry

    def evict(self, name: str) -> None:
        entry = self._resident.pop(name)
        self.pool.pages.free(entry.key)
        self.evictions += 1

    def make_room(self, num_pages: int, pinned: set[str]) -> bool:
        """Evict unpinned adapters, least recently used first, until num_pages are free."""
        for name in list(self._resident):
            if self.pool.pages.can_allocate(num_pages):
                break
            if name not in pinned:
                self.evict(name)
        return self.pool.pages.can_allocate(num_pages)

    def resident_names(self) -> list[str]:
        return list(self._resident)

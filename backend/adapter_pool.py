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
        self._resident: OrderedDict[tuple[str, str], ResidentAdapter] = OrderedDict()  # (name, sha256)
        self.uploads = 0
        self.evictions = 0

    def get(self, spec: AdapterSpec) -> ResidentAdapter | None:
        key = (spec.name, spec.sha256)
        entry = self._resident.get(key)
        if entry is not None:
            self._resident.move_to_end(key)
        return entry

    def upload(self, packed: PackedAdapter) -> ResidentAdapter:
        """Copy a packed adapter into free pages (the caller made room).

        Versions of one name are separate entries: requests admitted with an older
        version keep reading it until they finish.
        """
        name = packed.spec.name
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
        self._resident[(name, packed.spec.sha256)] = entry
        self.uploads += 1
        return entry

    def evict(self, key: tuple[str, str]) -> None:
        entry = self._resident.pop(key)
        self.pool.pages.free(entry.key)
        self.evictions += 1

    def make_room(self, num_pages: int, pinned: set[tuple[str, str]]) -> bool:
        """Evict unpinned adapter versions, least recently used first, until num_pages are free."""
        for key in list(self._resident):
            if self.pool.pages.can_allocate(num_pages):
                break
            if key not in pinned:
                self.evict(key)
        return self.pool.pages.can_allocate(num_pages)

    def resident_names(self) -> list[str]:
        return [f"{name}@{sha[:12]}" for name, sha in self._resident]

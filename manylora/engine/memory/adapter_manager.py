"""The adapter tiers together: disk catalogue -> host-memory cache -> GPU pool.

The scheduler asks whether a request's adapter is ready, what admitting it costs in pages,
to make room by evicting idle adapters, and to make it resident.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from manylora.engine.adapters.catalogue import AdapterCatalogue
from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.packing import pages_for
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.memory.adapter_slots import AdapterPool, ResidentAdapter
from manylora.engine.memory.unified_pool import UnifiedPool


class Readiness(Enum):
    RESIDENT = "resident"  # in the GPU pool
    UPLOADING = "uploading"  # pages taken in the pool, the copy into them still running
    HOST = "host"  # in host memory, one copy away
    LOADING = "loading"  # being read from disk


class AdapterMirror(Protocol):
    """Other holders of the pool's layout that must follow its adapter placements (the other
    tensor-parallel ranks: manylora/engine/parallel/runtime.py)."""

    def prefetch(self, spec: AdapterSpec) -> None: ...

    def place(self, spec: AdapterSpec, pages: list[int]) -> None: ...


class AdapterManager:
    def __init__(self, catalogue: AdapterCatalogue, pool: UnifiedPool, host: HostAdapterCache, device: str,
                 mirror: AdapterMirror | None = None) -> None:
        self.catalogue = catalogue
        self.pool = pool
        self.host = host
        self.mirror = mirror
        self.gpu = AdapterPool(pool, device, on_place=mirror.place if mirror is not None else None)
        self._pages_cache: dict[tuple[str, str], int] = {}

    def pages(self, spec: AdapterSpec) -> int:
        key = (spec.name, spec.sha256)
        if key not in self._pages_cache:
            self._pages_cache[key] = pages_for(spec, self.pool.cfg, self.pool.page_elems)
        return self._pages_cache[key]

    def prefetch(self, spec: AdapterSpec) -> None:
        if self.gpu.get(spec) is None:
            self.host.request(spec)
            if self.mirror is not None:
                self.mirror.prefetch(spec)

    def readiness(self, spec: AdapterSpec) -> Readiness:
        """Where the adapter is; raises its AdapterError if it failed to load."""
        entry = self.gpu.get(spec)
        if entry is not None:
            return Readiness.RESIDENT if entry.ready() else Readiness.UPLOADING
        return Readiness.HOST if self.host.is_loaded(spec) else Readiness.LOADING

    def pages_to_admit(self, spec: AdapterSpec) -> int:
        return 0 if self.gpu.get(spec) is not None else self.pages(spec)

    def make_room(self, num_pages: int, pinned: set[tuple[str, str]]) -> bool:
        return self.gpu.make_room(num_pages, pinned)

    def make_resident(self, spec: AdapterSpec) -> ResidentAdapter:
        """Copy the adapter into the pool on this thread (waiting for a copy in flight)."""
        entry = self.gpu.get(spec)
        if entry is not None:
            entry.wait()
            return entry
        packed = self.host.get(spec)
        assert packed is not None, f"adapter '{spec.name}' made resident before it was loaded"
        return self.gpu.upload(packed)

    def start_upload(self, spec: AdapterSpec) -> ResidentAdapter:
        """Take the adapter's pages and copy it in off this thread (the caller made room)."""
        entry = self.gpu.get(spec)
        if entry is not None:
            return entry
        packed = self.host.get(spec)
        assert packed is not None, f"adapter '{spec.name}' uploaded before it was loaded"
        return self.gpu.begin_upload(packed)

    def resident(self, spec: AdapterSpec) -> ResidentAdapter:
        entry = self.gpu.get(spec)
        assert entry is not None, f"adapter '{spec.name}' is not resident"
        return entry

    def stats(self) -> dict:
        usage = self.pool.usage()
        return {
            "pool_pages_total": self.pool.num_pages,
            "pool_pages_kv": usage["kv"],
            "pool_pages_adapters": usage["adapters"],
            "pool_pages_free": usage["free"],
            "adapters_resident": self.gpu.resident_names(),
            "adapters_uploading": self.gpu.uploading(),
            "adapter_uploads": self.gpu.uploads,
            "adapter_evictions": self.gpu.evictions,
            **self.host.stats(),
        }


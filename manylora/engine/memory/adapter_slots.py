"""The GPU tier: adapters resident in the unified pool, least recently used out first.

An adapter used by a running request is pinned by the caller and never evicted.

Copies into the pool can run off the engine thread (``begin_upload``): the engine thread
takes the pages and computes the offset tables, a worker thread copies the packed weights
in on a side CUDA stream, and the adapter counts as resident once that copy has finished
(``ResidentAdapter.ready``). A copy from pageable host memory blocks the thread that issues it; at 84 MB
per rank-16 Llama-3-8B adapter that was the engine thread's time before. The worker stages the copy through
pinned buffers (manylora/engine/memory/pinned_copy.py), so that the engine thread's own small copies do not queue
behind it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from manylora.engine.adapters.packing import PackedAdapter
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.memory.pinned_copy import PinnedStager
from manylora.engine.memory.unified_pool import AdapterKey, UnifiedPool


@dataclass
class ResidentAdapter:
    key: AdapterKey
    spec: AdapterSpec
    row_offsets: torch.Tensor  # int64 [layers, 7, 2, max_rank]: absolute pool element offsets, -1 unused
    ranks: torch.Tensor  # int32 [layers, 7]
    scalings: torch.Tensor  # float32 [layers, 7]
    num_pages: int
    copy: Future | None = field(default=None, repr=False)  # the copy into the pool, while it runs
    copied: torch.cuda.Event | None = field(default=None, repr=False)  # recorded after it on the side stream

    def ready(self) -> bool:
        """Whether the weights are in the pool (kernels launched from now on read them whole)."""
        if self.copy is None:
            return True
        if not self.copy.done() or (self.copied is not None and not self.copied.query()):
            return False
        self.copy.result()  # re-raises a failed copy
        self.copy = self.copied = None
        return True

    def wait(self) -> None:
        if self.copy is not None:
            self.copy.result()
            if self.copied is not None:
                self.copied.synchronize()
            self.copy = self.copied = None


class AdapterPool:
    def __init__(self, pool: UnifiedPool, device: str,
                 on_place: Callable[[AdapterSpec, list[int]], None] | None = None) -> None:
        """on_place(spec, pages), if given, hears of every adapter placed, before its copy starts
        (tensor-parallel rank 0 tells the other ranks to copy their shards into the same pages)."""
        self.pool = pool
        self.device = device
        self.on_place = on_place
        self._resident: OrderedDict[tuple[str, str], ResidentAdapter] = OrderedDict()  # (name, sha256)
        self.uploads = 0
        self.evictions = 0
        self._copier: ThreadPoolExecutor | None = None  # one thread: the stager's buffers are its own
        self._stream = None
        self._stager: PinnedStager | None = None

    def get(self, spec: AdapterSpec) -> ResidentAdapter | None:
        """The version's entry if it has pages in the pool (its copy may still run: see ``ResidentAdapter.ready``)."""
        key = (spec.name, spec.sha256)
        entry = self._resident.get(key)
        if entry is not None:
            self._resident.move_to_end(key)
        return entry

    def upload(self, packed: PackedAdapter) -> ResidentAdapter:
        """Copy a packed adapter into free pages (the caller made room), on this thread.

        Versions of one name are separate entries: requests admitted with an older
        version keep reading it until they finish.
        """
        entry, page_ids = self._place(packed)
        self._copy(packed, page_ids, None)
        return entry

    def begin_upload(self, packed: PackedAdapter) -> ResidentAdapter:
        """Take pages for the adapter (the caller made room) and copy it in on a worker thread; the entry
        is ready (``ResidentAdapter.ready``) when the copy has finished."""
        entry, page_ids = self._place(packed)
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-copy")
        after = None
        if self.device.startswith("cuda"):
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))  # pages just freed may still be read by
            # work already launched: the copy waits for it
            entry.copied = torch.cuda.Event()
        entry.copy = self._copier.submit(self._copy, packed, page_ids, after, entry.copied)
        return entry

    def _place(self, packed: PackedAdapter) -> tuple[ResidentAdapter, torch.Tensor]:
        name = packed.spec.name
        key = AdapterKey(name, packed.spec.sha256)
        pages = self.pool.pages.allocate(key, packed.num_pages)
        if self.on_place is not None:
            try:
                self.on_place(packed.spec, pages)
            except BaseException:
                self.pool.pages.free(key)
                raise
        page_ids = torch.tensor(pages, dtype=torch.int64)
        pe = self.pool.page_elems
        rel = packed.row_offsets
        absolute = torch.where(rel >= 0, page_ids[rel.clamp(min=0) // pe] * pe + rel.clamp(min=0) % pe, rel)
        entry = ResidentAdapter(key, packed.spec, absolute.to(self.device), packed.ranks.to(self.device),
                                packed.scalings.to(self.device), packed.num_pages)
        self._resident[(name, packed.spec.sha256)] = entry
        self.uploads += 1
        return entry, page_ids

    def _copy(self, packed: PackedAdapter, page_ids: torch.Tensor, after: torch.cuda.Event | None,
              done: torch.cuda.Event | None = None) -> None:
        storage = self.pool.storage.view(self.pool.num_pages, self.pool.page_elems)
        if after is None:
            storage.index_copy_(0, page_ids.to(self.device), packed.data.to(self.device, non_blocking=True))
            return
        if self._stager is None:
            self._stager = PinnedStager()  # this copier thread's own: see manylora/engine/memory/pinned_copy.py
        with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            data = torch.empty(packed.data.shape, dtype=packed.data.dtype, device=self.device)
            self._stager.copy(packed.data.contiguous(), data, self._stream)
            ids = self._stager.copy(page_ids, torch.empty_like(page_ids, device=self.device), self._stream)
            storage.index_copy_(0, ids, data)
            done.record(self._stream)

    def evict(self, key: tuple[str, str]) -> None:
        entry = self._resident.pop(key)
        entry.wait()  # its pages are written until the copy ends
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

    def shutdown(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def uploading(self) -> int:
        return sum(1 for entry in self._resident.values() if entry.copy is not None)

    def resident_names(self) -> list[str]:
        return [f"{name}@{sha[:12]}" for name, sha in self._resident]

"""The host-memory tier: adapters read from disk, checked and packed, least recently used out.

Loads run on worker threads, so the engine can prefetch the adapters of queued
requests while the current step runs. A load that fails is remembered as an error
for that adapter version and handed to the requests that need it.

The GIL: every Triton kernel launch releases it, and a loader thread busy in Python then
keeps the engine thread waiting before its next launch. The engine closes ``launch_gate``
while it launches a step and opens it while the device computes; loaders wait at the gate
between modules, so their Python runs in the engine's idle time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import torch

from manylora.engine.adapters.packing import PackedAdapter, pack_adapter
from manylora.engine.adapters.process_loader import ProcessLoader
from manylora.engine.adapters.spec import AdapterSpec, LoraWeights
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import ModelConfig

log = logging.getLogger("manylora.host_cache")


class HostAdapterCache:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, page_elems: int, max_rank: int,
                 capacity: int | None, pin_memory: bool, workers: int = 2,
                 on_load: Callable[[str, float], None] | None = None, rehash: bool = False,
                 shard: Callable[[LoraWeights], LoraWeights] | None = None,
                 pack_config: ModelConfig | None = None, processes: int = 0,
                 max_bytes: int | None = None) -> None:
        """cfg: the base model adapters are checked against. A tensor-parallel rank passes ``shard``
        (its part of each loaded adapter; picklable when processes > 0) and ``pack_config`` (its
        local shapes, which the pool's pages are laid out for); otherwise adapters are packed whole
        for cfg. processes > 0: loads run in that many child processes
        (manylora/engine/adapters/process_loader.py), the worker threads only wait for them. capacity bounds
        the adapters kept, max_bytes their packed bytes (least recently used out first; the newest
        is always kept)."""
        self.cfg = cfg
        self.shard = shard
        self.pack_config = pack_config or cfg
        self.dtype = dtype
        self.page_elems = page_elems
        self.max_rank = max_rank
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._bytes = 0
        self.pin_memory = pin_memory
        self.on_load = on_load
        self.rehash = rehash
        self._lock = threading.Lock()
        self.launch_gate = threading.Event()  # open: loaders may run; the engine closes it while launching
        self.launch_gate.set()
        self._entries: OrderedDict[tuple[str, str], PackedAdapter] = OrderedDict()
        self._loading: dict[tuple[str, str], Future] = {}
        self._errors: dict[tuple[str, str], AdapterError] = {}
        self._processes = ProcessLoader(processes) if processes > 0 else None
        self._pool = ThreadPoolExecutor(max_workers=max(workers, processes), thread_name_prefix="adapter-load")
        self.hits = 0
        self.misses = 0
        self.loads = 0
        self.evictions = 0
        self.load_seconds = 0.0

    def request(self, spec: AdapterSpec) -> None:
        """Start loading the adapter if it is neither cached nor loading (a prefetch)."""
        key = (spec.name, spec.sha256)
        with self._lock:
            if key in self._entries or key in self._loading or key in self._errors:
                return
            self.misses += 1
            self._loading[key] = self._pool.submit(self._load, spec)

    def get(self, spec: AdapterSpec) -> PackedAdapter | None:
        """The packed adapter if loaded, counted as a hit (raises its AdapterError if loading failed);
        else None, and a load is started if none runs."""
        return self._lookup(spec, use=True)

    def contains(self, spec: AdapterSpec) -> bool:
        """Whether the adapter is loaded, without counting a hit or touching the LRU order."""
        with self._lock:
            return (spec.name, spec.sha256) in self._entries

    def is_loaded(self, spec: AdapterSpec) -> bool:
        """As ``get``, but a check, not a use: no hit is counted and the LRU order is kept."""
        return self._lookup(spec, use=False) is not None

    def _lookup(self, spec: AdapterSpec, use: bool) -> PackedAdapter | None:
        key = (spec.name, spec.sha256)
        with self._lock:
            packed = self._entries.get(key)
            if packed is not None:
                if use:
                    self._entries.move_to_end(key)
                    self.hits += 1
                return packed
            error = self._errors.get(key)
        if error is not None:
            raise error
        self.request(spec)
        return None

    def wait(self, spec: AdapterSpec, timeout: float | None = None) -> PackedAdapter:
        """Block until the adapter is loaded (for tools and tests)."""
        self.request(spec)
        with self._lock:
            future = self._loading.get((spec.name, spec.sha256))
        if future is not None:
            future.result(timeout)
        packed = self.get(spec)
        assert packed is not None
        return packed

    def _load(self, spec: AdapterSpec) -> None:
        key = (spec.name, spec.sha256)
        t0 = time.perf_counter()
        try:
            if self._processes is not None:
                packed = self._processes.load(spec, self.cfg, self.pack_config, self.dtype, self.page_elems,
                                              self.max_rank, self.rehash, self.shard)
            else:
                packed = self._load_here(spec)
        except CancelledError:  # the loaders stopped (shutdown, or a broken pool replaced): a later lookup reloads
            with self._lock:
                self._loading.pop(key, None)
            return
        except AdapterError as e:
            log.error("%s", e)
            with self._lock:
                self._errors[key] = e
                self._loading.pop(key, None)
            return
        except Exception as e:  # noqa: BLE001 - any failure is this adapter's, not the server's
            log.exception("adapter '%s' failed to load", spec.name)
            with self._lock:
                self._errors[key] = AdapterError(spec.name, f"failed to load: {e}")
                self._loading.pop(key, None)
            return
        with self._lock:
            self._entries[key] = packed
            self._bytes += packed.nbytes
            self._loading.pop(key, None)
            self.loads += 1
            seconds = time.perf_counter() - t0
            self.load_seconds += seconds
            while len(self._entries) > 1 and self._over_limits():
                self._bytes -= self._entries.popitem(last=False)[1].nbytes
                self.evictions += 1
        if self.on_load is not None:
            self.on_load(spec.name, seconds)

    def _over_limits(self) -> bool:
        return ((self.capacity is not None and len(self._entries) > self.capacity)
                or (self.max_bytes is not None and self._bytes > self.max_bytes))

    def _load_here(self, spec: AdapterSpec) -> PackedAdapter:
        """Read, check and pack on this thread, waiting at the launch gate between modules."""
        pause = self.launch_gate.wait
        weights = load_adapter_weights(spec, self.cfg, dtype=self.dtype, device="cpu", pause=pause,
                                       rehash=self.rehash)
        if self.shard is not None:
            weights = self.shard(weights)
        return pack_adapter(weights, self.pack_config, self.page_elems, self.max_rank, pin_memory=self.pin_memory,
                            pause=pause)

    def wait_started(self, timeout: float | None = None) -> None:
        """Block until the loader processes (if any) have started their interpreters (tools, benchmarks)."""
        if self._processes is not None:
            self._processes.wait_started(timeout)

    def stats(self) -> dict:
        with self._lock:
            return {"host_cached": len(self._entries), "host_loading": len(self._loading),
                    "host_hits": self.hits, "host_misses": self.misses, "host_loads": self.loads,
                    "host_evictions": self.evictions, "host_load_seconds": round(self.load_seconds, 3),
                    "host_bytes": self._bytes, "host_bytes_limit": self.max_bytes}

    def shutdown(self) -> None:
        self.launch_gate.set()  # a loader waiting at the gate finishes instead of hanging
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown()

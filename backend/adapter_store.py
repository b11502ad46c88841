"""Adapters whose weights are loaded on the engine's device, least recently used first out.

An adapter that a running request uses is pinned and never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from backend.adapter import AdapterSpec, LoraWeights, load_adapter_weights
from backend.model_config import ModelConfig


class AdapterStore:
    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: str, capacity: int | None) -> None:
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.capacity = capacity
        self._loaded: OrderedDict[str, LoraWeights] = OrderedDict()
        self.loads = 0
        self.evictions = 0
        self.hits = 0

    def get(self, spec: AdapterSpec, pinned: set[str]) -> LoraWeights:
        """The adapter's weights, loading them (and evicting unpinned ones) if needed."""
        loaded = self._loaded.get(spec.name)
        if loaded is not None and loaded.spec.sha256 == spec.sha256:
            self._loaded.move_to_end(spec.name)
            self.hits += 1
            return loaded
        weights = load_adapter_weights(spec, self.model_config, dtype=self.dtype, device=self.device)
        self.loads += 1
        self._loaded[spec.name] = weights
        self._loaded.move_to_end(spec.name)
        self._evict(pinned | {spec.name})
        return weights

    def _evict(self, pinned: set[str]) -> None:
        if self.capacity is None:
            return
        for name in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if name not in pinned:
                del self._loaded[name]
                self.evictions += 1

    def resident(self) -> list[str]:
        return list(self._loaded)

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self._loaded.values())

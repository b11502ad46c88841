"""Applies each token's adapter to a projection: y += scaling * (x @ A^T) @ B^T.

This is the reference path (torch, grouped by adapter): it runs on the CPU and is
what the Triton kernels in kernels/ are checked against.
"""

from __future__ import annotations

import torch

from backend.adapter import LoraWeights


class LoraBatch:
    """Which adapter serves each token of a step; -1 rows have none."""

    def __init__(self, token_slots: list[int], adapters: list[LoraWeights], device: str) -> None:
        self.adapters = adapters
        self.token_slots = torch.tensor(token_slots, dtype=torch.int64, device=device)
        self._rows: list[torch.Tensor] = []
        for slot in range(len(adapters)):
            rows = [i for i, s in enumerate(token_slots) if s == slot]
            self._rows.append(torch.tensor(rows, dtype=torch.int64, device=device))

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, module: str) -> None:
        """Add each row's LoRA delta into out [T, out_features] (in place); x is [T, in]."""
        for slot, adapter in enumerate(self.adapters):
            weights = adapter.weights.get((layer, module))
            rows = self._rows[slot]
            if weights is None or rows.numel() == 0:
                continue
            a, b, scaling = weights
            xs = x.index_select(0, rows)
            delta = (xs @ a.t()) @ b.t()
            out.index_add_(0, rows, delta, alpha=scaling)

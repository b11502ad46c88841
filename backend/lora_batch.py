"""Applies each token's adapter to a projection: out += scaling * (x @ A^T) @ B^T.

Adapter weights are read where they lie in the unified pool, through per-step tables
of rank-row offsets ([layer, projection, A|B, slot, rank]). The torch path below gathers
the rows it needs and is the reference the Triton kernels (kernels/) are checked against.
"""

from __future__ import annotations

import torch

from backend.adapter_packing import MODULE_INDEX
from backend.adapter_pool import ResidentAdapter


class LoraBatch:
    """Which adapter slot serves each token of a step (-1: none), and the slots' tables."""

    def __init__(self, token_slots: list[int], adapters: list[ResidentAdapter], pool: torch.Tensor,
                 device: str) -> None:
        self.adapters = adapters
        self.pool = pool
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        # [layers, 7, 2, S, R], [layers, 7, S], [layers, 7, S]
        self.row_offsets = torch.stack([a.row_offsets for a in adapters], dim=3).contiguous()
        self.ranks = torch.stack([a.ranks for a in adapters], dim=2).contiguous()
        self.scalings = torch.stack([a.scalings for a in adapters], dim=2).contiguous()
        self._ranks_host = self.ranks.cpu()
        self._scalings_host = self.scalings.cpu()
        self._rows = [torch.tensor([i for i, s in enumerate(token_slots) if s == slot], dtype=torch.int64,
                                   device=device) for slot in range(len(adapters))]

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, module: str) -> None:
        """Add each row's LoRA delta into out [T, out_features] (in place); x is [T, in_features]."""
        m = MODULE_INDEX[module]
        n_in, n_out = x.shape[1], out.shape[1]
        for slot in range(len(self.adapters)):
            r = int(self._ranks_host[layer, m, slot])
            rows = self._rows[slot]
            if r == 0 or rows.numel() == 0:
                continue
            a_offs = self.row_offsets[layer, m, 0, slot, :r]
            b_offs = self.row_offsets[layer, m, 1, slot, :r]
            a = self.pool[a_offs[:, None] + torch.arange(n_in, device=x.device)]  # [r, in]
            bt = self.pool[b_offs[:, None] + torch.arange(n_out, device=x.device)]  # [r, out]
            delta = (x.index_select(0, rows) @ a.t()) @ bt
            out.index_add_(0, rows, delta, alpha=float(self._scalings_host[layer, m, slot]))

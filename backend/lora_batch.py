"""Applies each token's adapter to projections: out += scaling * (x @ A^T) @ B^T.

Adapter weights are read where they lie in the unified pool, through per-step tables of
rank-row offsets ([layer, projection, A|B, slot, rank]). Projections that share an input
(q/k/v, gate/up) go in one call, their outputs side by side in ``out``. Two paths:
"torch" gathers the rows it needs (the CPU path, and the reference); "triton" launches the
shrink/expand kernels of kernels/, which read the rows in place.

MoE bases: slots 7 + 2e (+1) of the module axis hold expert e's gate_up_proj (down_proj) rows
(backend/adapter_packing.py); ``apply_expert`` adds them for the (token, expert) pairs routed to e,
gathering the rows in torch on either path.
"""

from __future__ import annotations

import torch

from backend.adapter_packing import MODULE_INDEX, expert_slot
from backend.adapter_pool import ResidentAdapter
from backend.model_config import PROJECTIONS

# Tokens per step above which the segmented (SGMV) kernels beat one program per token.
SEGMENTED_MIN_TOKENS = 64


class LoraBatch:
    """Which adapter slot serves each token of a step (-1: none), and the slots' tables."""

    def __init__(self, token_slots: list[int], adapters: list[ResidentAdapter], pool: torch.Tensor, device: str,
                 use_kernels: bool = False) -> None:
        self.adapters = adapters
        self.pool = pool
        self.use_kernels = use_kernels
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        # [layers, 7, 2, S, R], [layers, 7, S], [layers, 7, S]
        self.row_offsets = torch.stack([a.row_offsets for a in adapters], dim=3).contiguous()
        self.ranks = torch.stack([a.ranks for a in adapters], dim=2).contiguous()
        self.scalings = torch.stack([a.scalings for a in adapters], dim=2).contiguous()
        self.max_rank = self.row_offsets.shape[-1]
        self.segments = None
        self._expert_ranks_host = self.ranks[:, len(PROJECTIONS):].cpu() if self._has_expert_slots() else None
        self._expert_scalings_host = self.scalings[:, len(PROJECTIONS):].cpu() if self._has_expert_slots() else None
        if use_kernels:
            if len(token_slots) >= SEGMENTED_MIN_TOKENS:
                from kernels.lora_meta import build_segments

                self.segments = build_segments(torch.tensor(token_slots, dtype=torch.int32), device=device)
        else:
            self._ranks_host = self.ranks.cpu()
            self._scalings_host = self.scalings.cpu()
            self._rows = [torch.tensor([i for i, s in enumerate(token_slots) if s == slot], dtype=torch.int64,
                                       device=device) for slot in range(len(adapters))]

    @classmethod
    def from_tables(cls, token_slots: torch.Tensor, row_offsets: torch.Tensor, ranks: torch.Tensor,
                    scalings: torch.Tensor, pool: torch.Tensor) -> LoraBatch:
        """A kernel-path batch over preallocated tables (CUDA-graph replay fills them in place)."""
        batch = cls.__new__(cls)
        batch.adapters = []
        batch.pool = pool
        batch.use_kernels = True
        batch.token_slots = token_slots
        batch.row_offsets, batch.ranks, batch.scalings = row_offsets, ranks, scalings
        batch.max_rank = row_offsets.shape[-1]
        batch.segments = None
        return batch

    def _has_expert_slots(self) -> bool:
        return self.row_offsets.dim() == 5 and self.row_offsets.shape[1] > len(PROJECTIONS)

    def has_expert_lora(self, layer: int) -> bool:
        """Whether any adapter of the step adapts layer's experts."""
        ranks = getattr(self, "_expert_ranks_host", None)
        return ranks is not None and bool((ranks[layer] > 0).any())

    def moe_lora(self, layer: int):
        """The layer's expert adapters as the fused MoE-LoRA kernel takes them (kernels.fused_moe_lora.MoeLora),
        or None when the kernel cannot express them: it has one rank and one scaling per adapter for both
        expert parameters, so an adapter whose gate_up and down ranks or scalings differ (PEFT's renamed
        transformers-4 targets give gate_up rank 2r) goes through apply_expert instead."""
        from kernels.fused_moe_lora import MoeLora

        ranks = self._expert_ranks_host[layer]  # [2E, S]: expert e's gate_up at 2e, down at 2e + 1
        scalings = self._expert_scalings_host[layer]
        gate_up, down = ranks[0::2], ranks[1::2]  # [E, S]
        if not (bool((gate_up == gate_up[:1]).all()) and bool((down == down[:1]).all())):
            return None
        r13, r2 = gate_up[0], down[0]
        s13, s2 = scalings[0], scalings[1]
        used = (r13 > 0) | (r2 > 0)
        if bool(((r13 != r2) & used).any()) or bool(((s13 != s2) & used).any()):
            return None
        slot_has = used.to(self.token_slots.device)
        token_slots = torch.where((self.token_slots >= 0) & slot_has[self.token_slots.clamp(min=0).long()],
                                  self.token_slots, torch.full_like(self.token_slots, -1))
        first = len(PROJECTIONS)
        tables = self.row_offsets[layer, first:]  # [2E, 2, S, R]

        def by_slot(parameter: int, kind: int) -> torch.Tensor:
            return tables[parameter::2, kind].permute(1, 0, 2).contiguous()  # [S, E, R]

        return MoeLora(pool=self.pool, a13_offsets=by_slot(0, 0), b13_offsets=by_slot(0, 1),
                       a2_offsets=by_slot(1, 0), b2_offsets=by_slot(1, 1),
                       ranks=r13.clamp(min=1).to(torch.int32).to(self.pool.device),
                       scalings=s13.to(torch.float32).to(self.pool.device), token_slots=token_slots)

    def apply_expert(self, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, layer: int, expert: int,
                     parameter: int) -> None:
        """Add expert ``expert``'s LoRA delta of ``parameter`` (0: gate_up_proj, 1: down_proj) into out [n, width]
        for inputs x [n, in], row i being batch token tokens[i] routed to that expert (each with its own adapter)."""
        m = expert_slot(expert, parameter)
        ranks = self._expert_ranks_host[layer, m - len(PROJECTIONS)]
        slots = self.token_slots.index_select(0, tokens)
        n_in, n_out = x.shape[1], out.shape[1]
        for slot in range(ranks.shape[0]):
            r = int(ranks[slot])
            if r == 0:
                continue
            rows = torch.nonzero(slots == slot).flatten()
            if rows.numel() == 0:
                continue
            a = self.pool[self.row_offsets[layer, m, 0, slot, :r, None] + torch.arange(n_in, device=x.device)]
            bt = self.pool[self.row_offsets[layer, m, 1, slot, :r, None] + torch.arange(n_out, device=x.device)]
            delta = (x.index_select(0, rows) @ a.t()) @ bt
            out.index_add_(0, rows, delta, alpha=float(self.scalings[layer, m, slot]))

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, modules: tuple[str, ...],
              widths: tuple[int, ...]) -> None:
        """Add the LoRA deltas of ``modules`` (consecutive projections sharing input x [T, in]) into
        out [T, sum(widths)], module i owning columns [sum(widths[:i]), sum(widths[:i+1]))."""
        first = MODULE_INDEX[modules[0]]
        if self.use_kernels:
            self._apply_kernels(x, out, layer, first, len(modules), widths)
        else:
            col = 0
            for i, width in enumerate(widths):
                self._apply_torch(x, out[:, col:col + width], layer, first + i)
                col += width

    def _apply_kernels(self, x: torch.Tensor, out: torch.Tensor, layer: int, first: int, n: int,
                       widths: tuple[int, ...]) -> None:
        from kernels.lora_expand import lora_expand
        from kernels.lora_shrink import lora_shrink

        mods = slice(first, first + n)
        y = torch.empty((n, x.shape[0], self.max_rank), dtype=torch.float32, device=x.device)
        lora_shrink(x, self.pool, self.row_offsets[layer, mods, 0], self.ranks[layer, mods], self.token_slots, y,
                    segments=self.segments)
        bounds = [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        lora_expand(y, self.pool, self.row_offsets[layer, mods, 1], self.ranks[layer, mods],
                    self.scalings[layer, mods], self.token_slots, out, bounds, segments=self.segments)

    def _apply_torch(self, x: torch.Tensor, out: torch.Tensor, layer: int, m: int) -> None:
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

"""A projection's LoRA term left as its factors, for the kernel that consumes the projection's output to expand.

In a captured decode step the shrink of a projection runs beside its base GEMM. Its expand can then be written into
an fp32 buffer that the consumer adds (``lora_expand(..., overwrite=True)``), or not launched at all: the consumer
(residual add + RMSNorm, silu * up) reads the shrink's output and the adapters' B^T rows itself and computes the term
for the columns it handles (``kernels.expand_tiles.lora_term``, the BGMV expand's arithmetic). That saves the
expand's launch and the fp32 buffer's write and read (11 MB a layer for Llama-3-8B at 64 tokens), for B^T reads
inside the consumer.

    factors = LoraFactors(y, pool, b_row_offsets, ranks, scalings, token_slots, widths=(I, I))
    out = silu_mul(gate_up, factors)            # as silu_mul(gate_up, factors.materialize()), without the buffer
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora_meta import FLOAT_DTYPES, check_shape, check_tensor

# no triton import here: backend/lora_batch.py imports this module on every path, the torch one included

__all__ = ["LoraFactors"]


@dataclass(frozen=True)
class LoraFactors:
    """The LoRA term of a projection of ``len(widths)`` slices, unexpanded.

    Semantics (slice i covers the columns sum(widths[:i]) .. + widths[i] of the projection's output)::

        s = token_slots[t]
        term[t, col of slice i, c] = 0                                         if s < 0
                                   = scalings[i, s] * sum_k<ranks[i, s] y[i, t, k] * pool[b_row_offsets[i, s, k] + c]

    as ``lora_expand(y, pool, b_row_offsets, ranks, scalings, token_slots, term, bounds, overwrite=True)`` writes it.
    """

    y: torch.Tensor  # fp32 [NS, T, R_max]: the shrink's output
    pool: torch.Tensor  # the flat pool holding B^T's rank rows
    b_row_offsets: torch.Tensor  # int64 [NS, S, R_max]
    ranks: torch.Tensor  # int32 [NS, S]
    scalings: torch.Tensor  # fp32 [NS, S]
    token_slots: torch.Tensor  # int32 [T], -1: no adapter
    widths: tuple[int, ...]  # each slice's columns

    @property
    def num_tokens(self) -> int:
        return self.y.shape[1]

    def check(self, num_tokens: int, widths: tuple[int, ...], device: torch.device) -> None:
        """Raise ValueError/TypeError unless these factors are a term of ``num_tokens`` rows and slices ``widths``
        on ``device``."""
        check_tensor("lora y", self.y, dtype=torch.float32, dims=3, device=device)
        num_slices, _, max_rank = self.y.shape
        check_shape("lora y", self.y, (len(widths), num_tokens, max_rank))
        if tuple(self.widths) != tuple(widths):
            raise ValueError(f"the LoRA factors are for slices of widths {tuple(self.widths)}, the kernel's output "
                             f"has {tuple(widths)}")
        check_tensor("lora pool", self.pool, dtype=FLOAT_DTYPES, dims=1, device=device)
        if not self.pool.is_contiguous():
            raise ValueError("the LoRA factors' pool must be contiguous")
        check_tensor("lora b_row_offsets", self.b_row_offsets, dtype=torch.int64, dims=3, device=device)
        num_slots = self.b_row_offsets.shape[1]
        check_shape("lora b_row_offsets", self.b_row_offsets, (num_slices, num_slots, max_rank))
        check_tensor("lora ranks", self.ranks, dtype=torch.int32, dims=2, device=device)
        check_shape("lora ranks", self.ranks, (num_slices, num_slots))
        check_tensor("lora scalings", self.scalings, dtype=torch.float32, dims=2, device=device)
        check_shape("lora scalings", self.scalings, (num_slices, num_slots))
        check_tensor("lora token_slots", self.token_slots, dtype=torch.int32, dims=1, device=device)
        check_shape("lora token_slots", self.token_slots, (num_tokens,))

    def kernel_args(self) -> tuple:
        """The consumer kernels' LoRA arguments, in their order: y, pool, b_row_offsets, ranks, scalings,
        token_slots, then y's, b_row_offsets', ranks' and scalings' strides."""
        y, b, r, s = self.y, self.b_row_offsets, self.ranks, self.scalings
        return (y, self.pool, b, r, s, self.token_slots, y.stride(0), y.stride(1), y.stride(2),
                b.stride(0), b.stride(1), b.stride(2), r.stride(0), r.stride(1), s.stride(0), s.stride(1))

    def kernel_meta(self, max_block_r: int = 16) -> dict[str, int]:
        """The consumer kernels' LoRA compile-time parameters: rank rows per unrolled chunk (at most
        ``max_block_r``: a kernel whose tiles are large unrolls fewer, or spills), 16 bytes in elements."""
        return {"LORA_BLOCK_R": min(max_block_r, 1 << (max(1, self.y.shape[2]) - 1).bit_length()),
                "LORA_ALIGN": 16 // self.pool.element_size()}

    def materialize(self) -> torch.Tensor:
        """The term as an fp32 [T, sum(widths)] tensor, in torch ops (the reference, and the unfused paths)."""
        slots = self.token_slots.long()
        active = slots >= 0
        sel = slots.clamp(min=0)
        max_rank = self.y.shape[2]
        ks = torch.arange(max_rank, device=self.y.device)
        parts = []
        for i, width in enumerate(self.widths):
            rank = self.ranks[i, sel].long()  # [T]
            live = (ks[None, :] < rank[:, None]) & active[:, None]  # [T, R]
            offs = torch.where(live, self.b_row_offsets[i, sel], 0)  # [T, R]
            cols = torch.arange(width, device=self.y.device)
            bt = torch.where(live[:, :, None], self.pool[offs[:, :, None] + cols], 0)  # [T, R, width]
            y = torch.where(live, self.y[i], 0.0)
            term = torch.einsum("tr,trc->tc", y, bt.float()) * self.scalings[i, sel][:, None]
            parts.append(torch.where(active[:, None], term, 0.0))
        return torch.cat(parts, dim=1) if parts else self.y.new_zeros((self.num_tokens, 0))

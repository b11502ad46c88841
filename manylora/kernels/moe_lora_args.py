"""Argument checks shared by the two forms of the MoE-LoRA kernels, ``manylora.kernels.moe_lora_blocks`` and
``manylora.kernels.moe_lora_pairs``: the same tensors, the same layouts (see ``fused_moe_lora.MoeLora``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manylora.kernels.lora_meta import check_shape, check_tensor, sliced_offsets


@dataclass(frozen=True)
class ShrinkArgs:
    offsets: torch.Tensor  # int64 [NS, S, E, R_max]
    y: torch.Tensor  # fp32 [NS, num_pairs, R_max]


@dataclass(frozen=True)
class ExpandArgs:
    offsets: torch.Tensor  # int64 [NS, S, E, R_max]
    y: torch.Tensor  # fp32 [NS, num_pairs, R_max]
    routed_weights: torch.Tensor  # fp32 [num_pairs], or y when there are none (not read then)
    slice_width: int


def check_shrink_args(a_in: torch.Tensor, pool: torch.Tensor, a_offsets: torch.Tensor, ranks: torch.Tensor,
                      y: torch.Tensor, num_pairs: int | None) -> ShrinkArgs:
    """a_in [rows, K_dim] of the pool's dtype, a flat contiguous pool, offsets [(NS,) S, E, R_max], int32 ranks [S],
    fp32 y [(NS,) num_pairs, R_max] (num_pairs None: y's)."""
    check_tensor("a_in", a_in, dims=2)
    device = a_in.device
    _check_pool(pool, device, a_in.dtype)
    a4 = sliced_offsets("a_offsets", a_offsets, device)
    num_slices, num_slots, _, max_rank = a4.shape
    check_tensor("ranks", ranks, dtype=torch.int32, dims=1, device=device)
    check_shape("ranks", ranks, (num_slots,))
    check_tensor("y", y, dtype=torch.float32, dims=(2, 3), device=device)
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    check_shape("y", y3, (num_slices, y3.shape[1] if num_pairs is None else num_pairs, max_rank))
    return ShrinkArgs(a4, y3)


def check_expand_args(y: torch.Tensor, pool: torch.Tensor, b_offsets: torch.Tensor, ranks: torch.Tensor,
                      scalings: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor | None,
                      num_pairs: int | None) -> ExpandArgs:
    """fp32 y [(NS,) num_pairs, R_max] (num_pairs None: y's), a flat contiguous pool, offsets of B^T rows
    [(NS,) S, E, R_max], int32 ranks and fp32 scalings [S], out [num_pairs, NS * W], optional fp32 routing weights
    [T, K] of num_pairs entries."""
    check_tensor("y", y, dtype=torch.float32, dims=(2, 3))
    device = y.device
    y3 = y.unsqueeze(0) if y.dim() == 2 else y
    _check_pool(pool, device, None)
    b4 = sliced_offsets("b_offsets", b_offsets, device)
    num_slices, num_slots, _, max_rank = b4.shape
    num_pairs = y3.shape[1] if num_pairs is None else num_pairs
    check_shape("y", y3, (num_slices, num_pairs, max_rank))
    check_tensor("ranks", ranks, dtype=torch.int32, dims=1, device=device)
    check_shape("ranks", ranks, (num_slots,))
    check_tensor("scalings", scalings, dtype=torch.float32, dims=1, device=device)
    check_shape("scalings", scalings, (num_slots,))
    check_tensor("out", out, dims=2, device=device)
    if out.shape[0] != num_pairs or out.shape[1] % num_slices:
        raise ValueError(f"out must have shape ({num_pairs}, NS * W) with NS = {num_slices}, got {tuple(out.shape)}")
    rw = y3  # not read without routing weights
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, dims=2, device=device)
        if topk_weights.numel() != num_pairs:
            raise ValueError(f"topk_weights must hold {num_pairs} weights, got {tuple(topk_weights.shape)}")
        rw = topk_weights.reshape(-1).contiguous()
    return ExpandArgs(b4, y3, rw, out.shape[1] // num_slices)


def _check_pool(pool: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> None:
    check_tensor("pool", pool, dtype=dtype, dims=1, device=device)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")

"""MoE-LoRA shrink and expand in decode form: one program per (token, k) pair, no block alignment of the pairs.

The block form (``manylora.kernels.moe_lora_blocks``) sorts the pairs by virtual expert ``slot * E + e``
(a second ``moe_align_block_size``: a sort and some twenty small kernels per layer) so that a
``tl.dot`` tile reads one (adapter, expert) LoRA matrix for many pairs. In a decode step there
are few pairs per (adapter, expert) (batch 64, top-8 of 128 experts, 8 adapters: ~0.5 on average),
so the tiles are mostly padding and the alignment's launches cost more than the reuse saves.
Here each program reads its pair's routed expert (``topk_ids``) and its token's adapter slot
(``token_slots``) and does a GEMV against that adapter's rows where they lie in the pool, like
the dense BGMV kernels (``manylora.kernels.lora_shrink``/``lora_expand``), with their row readers
(``bgmv_rows_dot``: 16 bytes an instruction where the rows start on 16 bytes; ``bgmv_expand_tile``: plain loads,
whose 16-byte path measured slower; the dense expand's row-streaming body is not used here yet).

Layouts are those of ``manylora.kernels.fused_moe_lora`` (``MoeLora``): row k of A_{s,e} for slice i at
pool element ``a_offsets[i, s, e, k]``, row k of B_{s,e}^T at ``b_offsets[i, s, e, k]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.kernels.expand_tiles import bgmv_expand_tile
from manylora.kernels.lora_meta import cdiv, check_shape, check_tensor
from manylora.kernels.lora_shrink import bgmv_rows_dot
from manylora.kernels.moe_lora_args import check_expand_args, check_shrink_args

__all__ = ["moe_lora_shrink_pairs", "moe_lora_expand_pairs", "pairs_shrink_config", "pairs_expand_config"]


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_shrink_pairs_kernel(
    a_ptr,  # [rows, K_DIM]: x (row = pair // rows_div) or h (row = pair)
    pool_ptr,  # flat pool
    a_offsets_ptr,  # int64 [NS, S, E, R_MAX]
    ranks_ptr,  # int32 [S]
    topk_ids_ptr,  # int32/int64 [num_pairs]: routed expert of each pair
    token_slots_ptr,  # int32 [num_pairs // top_k]: adapter slot of each token, -1 = none
    y_ptr,  # fp32 [NS, num_pairs, R_MAX]
    num_pairs,
    k_size,
    rows_div,
    top_k,
    stride_am,
    stride_ak,
    stride_os,
    stride_oslot,
    stride_oe,
    stride_or,
    stride_ys,
    stride_ym,
    stride_yr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_R_BLOCKS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # elements in 16 bytes of the pool dtype
):
    pair = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    slice_id = tl.program_id(2) // NUM_R_BLOCKS
    pid_r = tl.program_id(2) % NUM_R_BLOCKS
    slot = tl.load(token_slots_ptr + pair // top_k).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:
        return
    k_per_split = tl.cdiv(tl.cdiv(k_size, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    if k_start >= k_size:
        return
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    row_offs = tl.load(
        a_offsets_ptr + slice_id * stride_os + slot * stride_oslot + expert * stride_oe + offs_r * stride_or,
        mask=r_mask,
        other=0,
    ).to(tl.int64)
    acc = bgmv_rows_dot(a_ptr + (pair // rows_div) * stride_am, stride_ak, pool_ptr, row_offs, r_mask, k_start,
                        tl.minimum(k_start + k_per_split, k_size), k_size, BLOCK_R, BLOCK_K, False, ROW_ALIGN)
    y_ptrs = y_ptr + slice_id * stride_ys + pair * stride_ym + offs_r * stride_yr
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc, mask=r_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=r_mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_expand_pairs_kernel(
    y_ptr,  # fp32 [NS, num_pairs, R_MAX]
    pool_ptr,  # flat pool
    b_offsets_ptr,  # int64 [NS, S, E, R_MAX]
    ranks_ptr,  # int32 [S]
    scalings_ptr,  # fp32 [S]
    topk_ids_ptr,  # [num_pairs]
    token_slots_ptr,  # int32 [num_pairs // top_k]
    topk_weights_ptr,  # fp32 [num_pairs] (read with MUL_ROUTED_WEIGHT)
    out_ptr,  # [num_pairs, NS * slice_width], modified in place
    num_pairs,
    slice_width,
    top_k,
    stride_ys,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bslot,
    stride_be,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_N_BLOCKS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    slice_id = tl.program_id(1) // NUM_N_BLOCKS
    pid_n = tl.program_id(1) % NUM_N_BLOCKS
    slot = tl.load(token_slots_ptr + pair // top_k).to(tl.int64)
    if slot < 0:
        return
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    scaling = tl.load(scalings_ptr + slot)
    if MUL_ROUTED_WEIGHT:
        scaling = scaling * tl.load(topk_weights_ptr + pair).to(tl.float32)
    # as the block form: y rounded to the pool dtype, products accumulated in fp32
    bgmv_expand_tile(y_ptr + slice_id * stride_ys + pair * stride_ym, stride_yr,
                     b_offsets_ptr + slice_id * stride_bs + slot * stride_bslot + expert * stride_be, stride_br,
                     pool_ptr, out_ptr + pair * stride_om, stride_on, rank, scaling, slice_id * slice_width,
                     slice_width, pid_n, BLOCK_R, BLOCK_N, True)  # fmt: skip


def pairs_shrink_config(num_pairs: int, k_size: int, max_rank: int, num_slices: int) -> dict[str, int]:
    """Block sizes and split-K for ``moe_lora_shrink_pairs``: split the input width only while there are fewer
    than about two waves of an H200 (132 SMs) of programs; one split writes y with plain stores."""
    block_k = min(256, max(16, triton.next_power_of_2(k_size)))
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    programs = max(1, num_pairs * num_slices * cdiv(max_rank, block_r))
    split_k = max(1, min(16, cdiv(k_size, block_k), triton.next_power_of_2(cdiv(264, programs))))
    return {"BLOCK_R": block_r, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4}


def pairs_expand_config(slice_width: int) -> dict[str, int]:
    """Block sizes for ``moe_lora_expand_pairs``."""
    return {"BLOCK_R": 16, "BLOCK_N": min(256, max(16, triton.next_power_of_2(slice_width))), "num_warps": 4}


def _check_routing(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_pairs: int, device: torch.device) -> int:
    """top_k of the [T, K] routing, checked against the pair count and the [T] slots."""
    check_tensor("topk_ids", topk_ids, dims=2, device=device)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.numel() != num_pairs:
        raise ValueError(f"topk_ids holds {topk_ids.numel()} pairs, expected {num_pairs}")
    check_tensor("token_slots", token_slots, dtype=torch.int32, dims=1, device=device)
    check_shape("token_slots", token_slots, (topk_ids.shape[0],))
    return topk_ids.shape[1]


def moe_lora_shrink_pairs(
    a_in: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    rows_div: int,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """MoE-LoRA shrink, one program per pair (and K split, and rank block).

    Semantics::

        for p in range(T * K):  t = p // K;  s = token_slots[t];  e = topk_ids.flatten()[p]
            if s < 0: continue                                   # y[:, p] left as it was
            for i in range(NS):
                r = ranks[s]
                A = stack([pool[a_offsets[i, s, e, k] : ... + K_dim] for k in range(r)])   # [r, K_dim]
                y[i, p, :r] = A.float() @ a_in[p // rows_div].float()

    Entries past a slot's rank and rows of slot -1 pairs are not written (``moe_lora_expand_pairs``
    reads neither): ``y`` may come from ``torch.empty``.

    Args:
        a_in: [rows, K_dim], dtype of ``pool``; any strides.
        pool: [P] 1-D contiguous flat pool.
        a_offsets: int64 [S, E, R_max] or [NS, S, E, R_max].
        ranks: int32 [S].
        topk_ids: int32/int64 [T, K], contiguous: routed experts.
        token_slots: int32 [T]: adapter slot per token, -1 = none; in [-1, S).
        y: float32 [NS, T * K, R_max] (or [T * K, R_max] with 3-D offsets).
        rows_div: pair p reads row ``p // rows_div`` of ``a_in`` (K for x, 1 for h).
        config: keys of ``pairs_shrink_config``.
    """
    args = check_shrink_args(a_in, pool, a_offsets, ranks, y, None)
    a4, y3 = args.offsets, args.y
    num_slices, _, _, max_rank = a4.shape
    num_pairs = y3.shape[1]
    top_k = _check_routing(topk_ids, token_slots, num_pairs, a_in.device)
    k_size = a_in.shape[1]
    if num_pairs == 0 or max_rank == 0 or k_size == 0:
        return y
    cfg = dict(config or pairs_shrink_config(num_pairs, k_size, max_rank, num_slices))
    if cfg["SPLIT_K"] > 1:
        y3.zero_()  # the splits add into it
    num_r_blocks = cdiv(max_rank, cfg["BLOCK_R"])
    grid = (num_pairs, cfg["SPLIT_K"], num_slices * num_r_blocks)
    _moe_lora_shrink_pairs_kernel[grid](
        a_in, pool, a4, ranks, topk_ids.contiguous(), token_slots, y3,
        num_pairs, k_size, rows_div, top_k,
        a_in.stride(0), a_in.stride(1),
        a4.stride(0), a4.stride(1), a4.stride(2), a4.stride(3),
        y3.stride(0), y3.stride(1), y3.stride(2),
        NUM_R_BLOCKS=num_r_blocks,
        ROW_ALIGN=16 // pool.element_size(),
        **cfg,
    )  # fmt: skip
    return y


def moe_lora_expand_pairs(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    topk_ids: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """MoE-LoRA expand, one program per pair (and output tile), added in place into the expert GEMM output.

    Semantics::

        W = out.shape[1] // NS
        for p in range(T * K):  t = p // K;  s = token_slots[t];  e = topk_ids.flatten()[p]
            if s < 0: continue                                   # out[p] untouched
            for i in range(NS):
                r = ranks[s]
                Bt = stack([pool[b_offsets[i, s, e, k] : ... + W] for k in range(r)])   # [r, W]
                d = scalings[s] * (y[i, p, :r] @ Bt.float())
                if topk_weights is not None:
                    d *= topk_weights.flatten()[p]
                out[p, i * W : (i + 1) * W] += d                    # fp32 add, one cast

    Args:
        y: float32 [NS, T * K, R_max] (or [T * K, R_max]): ``moe_lora_shrink_pairs`` output.
        pool: [P] 1-D contiguous flat pool.
        b_offsets: int64 [S, E, R_max] or [NS, S, E, R_max]: rows of B^T.
        ranks: int32 [S]; scalings: float32 [S].
        topk_ids, token_slots: as the shrink.
        out: [T * K, NS * W], any float dtype and strides. Modified in place.
        topk_weights: optional fp32 [T, K]: multiply the delta of pair p by its routing weight.
        config: keys of ``pairs_expand_config``.
    """
    args = check_expand_args(y, pool, b_offsets, ranks, scalings, out, topk_weights, None)
    b4, y3, rw, slice_width = args.offsets, args.y, args.routed_weights, args.slice_width
    num_slices, _, _, max_rank = b4.shape
    num_pairs = y3.shape[1]
    top_k = _check_routing(topk_ids, token_slots, num_pairs, y.device)
    if num_pairs == 0 or max_rank == 0 or slice_width == 0:
        return out
    cfg = dict(config or pairs_expand_config(slice_width))
    num_n_blocks = cdiv(slice_width, cfg["BLOCK_N"])
    grid = (num_pairs, num_slices * num_n_blocks)
    _moe_lora_expand_pairs_kernel[grid](
        y3, pool, b4, ranks, scalings, topk_ids.contiguous(), token_slots, rw, out,
        num_pairs, slice_width, top_k,
        y3.stride(0), y3.stride(1), y3.stride(2),
        b4.stride(0), b4.stride(1), b4.stride(2), b4.stride(3),
        out.stride(0), out.stride(1),
        NUM_N_BLOCKS=num_n_blocks,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        **cfg,
    )  # fmt: skip
    return out

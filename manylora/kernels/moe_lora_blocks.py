"""MoE-LoRA shrink and expand in block form: tl.dot tiles over a second alignment by virtual expert.

Next to the base grouped GEMM (``manylora.kernels.fused_moe``), two kernels run over a second alignment of
the same (token, k) pairs, keyed by the virtual expert ``slot * E + expert`` (pairs of slot -1
dropped; see ``manylora.kernels.moe_align``), so every block reads exactly one (adapter, expert) pair of
LoRA matrices:

* shrink: y[slice, pair, :r] = A_{s,e} @ a_in[row(pair)], a tl.dot tile per block, split-K along
  the input width (the rank is skinny, so the K chunks are spread over programs and combined
  with tl.atomic_add into a zeroed fp32 buffer);
* expand: out[pair, slice cols] += scaling_s * (y @ B^T) (* routing weight for w2), added in
  place into the base GEMM's output, each element read and written once.

``manylora.kernels.fused_moe_lora.fused_moe_lora_forward`` takes this form for prefill-sized batches (a
tile then reads one (adapter, expert) matrix for many pairs) and ``manylora.kernels.moe_lora_pairs`` for
decode-sized ones. Layouts: ``manylora.kernels.fused_moe_lora.MoeLora``. Lengths are not specialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_meta import cdiv
from manylora.kernels.moe_align import MoeAlignment
from manylora.kernels.moe_lora_args import check_expand_args, check_shrink_args

__all__ = ["moe_lora_shrink", "moe_lora_expand", "moe_lora_shrink_config", "moe_lora_expand_config"]


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_shrink_kernel(
    # pointers
    a_ptr,  # [rows, K_DIM]: x (row = pair // rows_div) or h (row = pair)
    pool_ptr,  # flat pool
    a_offsets_ptr,  # int64 [NS, S, E, R_MAX]
    ranks_ptr,  # int32 [S]
    sorted_pair_ids_ptr,  # int32 [max_blocks * BLOCK_M]
    block_vexpert_ids_ptr,  # int32 [max_blocks]: slot * E + expert
    num_post_padded_ptr,  # int32 [1]
    y_ptr,  # fp32 [NS, num_pairs, R_MAX], zeroed, accumulated
    # sizes
    num_pairs,
    num_experts,
    k_size,
    rows_div,
    # strides
    stride_am,
    stride_ak,
    stride_os,
    stride_oslot,
    stride_oe,
    stride_or,
    stride_ys,
    stride_ym,
    stride_yr,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_R_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slice_id = tl.program_id(2) // NUM_R_BLOCKS
    pid_r = tl.program_id(2) % NUM_R_BLOCKS
    num_post_padded = tl.load(num_post_padded_ptr)
    if pid_m * BLOCK_M >= num_post_padded:
        return
    vexpert = tl.load(block_vexpert_ids_ptr + pid_m)
    if vexpert < 0:
        return
    slot = (vexpert // num_experts).to(tl.int64)
    expert = (vexpert % num_experts).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:
        return
    k_per_split = tl.cdiv(tl.cdiv(k_size, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    if k_start >= k_size:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)
    m_mask = pairs < num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    rows = pairs // rows_div
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    row_offs = tl.load(
        a_offsets_ptr + slice_id * stride_os + slot * stride_oslot + expert * stride_oe + offs_r * stride_or,
        mask=r_mask,
        other=0,
    ).to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k_size), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_size
        x = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            pool_ptr + row_offs[None, :] + offs_k[:, None],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R] = A^T tile
        acc += tl.dot(x.to(a.dtype), a, input_precision=DOT_PRECISION)
    tl.atomic_add(
        y_ptr + slice_id * stride_ys + pairs[:, None] * stride_ym + offs_r[None, :] * stride_yr,
        acc,
        mask=m_mask[:, None] & r_mask[None, :],
        sem="relaxed",
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_expand_kernel(
    # pointers
    y_ptr,  # fp32 [NS, num_pairs, R_MAX]
    pool_ptr,  # flat pool
    b_offsets_ptr,  # int64 [NS, S, E, R_MAX]
    ranks_ptr,  # int32 [S]
    scalings_ptr,  # fp32 [S]
    sorted_pair_ids_ptr,  # int32 [max_blocks * BLOCK_M]
    block_vexpert_ids_ptr,  # int32 [max_blocks]
    num_post_padded_ptr,  # int32 [1]
    topk_weights_ptr,  # fp32 [num_pairs] (read with MUL_ROUTED_WEIGHT)
    out_ptr,  # [num_pairs, NS * slice_width], modified in place
    # sizes
    num_pairs,
    num_experts,
    slice_width,
    # strides
    stride_ys,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bslot,
    stride_be,
    stride_br,
    stride_om,
    stride_on,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_N_BLOCKS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(1) // NUM_N_BLOCKS
    pid_n = tl.program_id(1) % NUM_N_BLOCKS
    num_post_padded = tl.load(num_post_padded_ptr)
    if pid_m * BLOCK_M >= num_post_padded:
        return
    vexpert = tl.load(block_vexpert_ids_ptr + pid_m)
    if vexpert < 0:
        return
    slot = (vexpert // num_experts).to(tl.int64)
    expert = (vexpert % num_experts).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    scaling = tl.load(scalings_ptr + slot)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)
    m_mask = pairs < num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < slice_width

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        y = tl.load(
            y_ptr + slice_id * stride_ys + pairs[:, None] * stride_ym + offs_r[None, :] * stride_yr,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        row_offs = tl.load(
            b_offsets_ptr + slice_id * stride_bs + slot * stride_bslot + expert * stride_be + offs_r * stride_br,
            mask=r_mask,
            other=0,
        ).to(tl.int64)
        b = tl.load(
            pool_ptr + row_offs[:, None] + offs_n[None, :],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N] = B^T tile
        # fp32 pool: exact fp32 dot; 16-bit pool: y rounded to the pool dtype, fp32 accumulation
        acc += tl.dot(y.to(b.dtype), b, input_precision=DOT_PRECISION)
    acc = acc * scaling
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0)
        acc = acc * rw.to(tl.float32)[:, None]

    cols = (slice_id * slice_width + offs_n).to(tl.int64)
    out_ptrs = out_ptr + pairs[:, None] * stride_om + cols[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + acc).to(base.dtype), mask=out_mask)


def moe_lora_shrink_config(
    num_pairs: int, num_experts: int, k_size: int, max_rank: int, num_slices: int, block_m: int
) -> dict[str, int]:
    """Block sizes and split-K for ``moe_lora_shrink`` (plain heuristic; tl.dot tiles >= 16).

    Split-K spreads the input width over programs until there are roughly two waves of an H100/
    H200 (132 SMs) worth of programs, estimating the used blocks from the pair count.
    """
    block_k = min(64, max(16, triton.next_power_of_2(k_size)))
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    k_chunks = cdiv(k_size, block_k)
    est_blocks = max(1, min(num_pairs, cdiv(num_pairs, block_m) + num_experts)) * num_slices
    split_k = max(1, min(16, k_chunks, triton.next_power_of_2(cdiv(264, est_blocks))))
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4}


def moe_lora_expand_config(slice_width: int, max_rank: int, block_m: int) -> dict[str, int]:
    """Block sizes for ``moe_lora_expand`` (plain heuristic; tl.dot tiles >= 16)."""
    block_n = min(128 if block_m <= 32 else 64, max(16, triton.next_power_of_2(slice_width)))
    return {"BLOCK_M": block_m, "BLOCK_R": 16, "BLOCK_N": block_n, "num_warps": 4}


def _check_lora_align(align: MoeAlignment, num_slots: int, num_experts: int, block_m: int) -> None:
    if not isinstance(align, MoeAlignment):
        raise TypeError(f"align must be a MoeAlignment, got {type(align).__name__}")
    if align.num_experts != num_slots * num_experts:
        raise ValueError(
            f"align has {align.num_experts} (virtual) experts, expected S * E = {num_slots} * {num_experts}: "
            "build it with moe_align_block_size(..., token_slots=, num_slots=)"
        )
    if align.block_m != block_m:
        raise ValueError(f"config BLOCK_M {block_m} != alignment block_m {align.block_m}")


def moe_lora_shrink(
    a_in: torch.Tensor,
    pool: torch.Tensor,
    a_offsets: torch.Tensor,
    ranks: torch.Tensor,
    align: MoeAlignment,
    y: torch.Tensor,
    *,
    rows_div: int,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """MoE-LoRA shrink over virtual-expert blocks, split-K, accumulated into ``y``.

    Semantics::

        for each block b of align, v = block_expert_ids[b], s, e = v // E, v % E:
            for each pair p of block b (not padding), for i in range(NS):
                r = ranks[s]
                A = stack([pool[a_offsets[i, s, e, k] : ... + K_dim] for k in range(r)])   # [r, K_dim]
                y[i, p, :r] += A.float() @ a_in[p // rows_div].float()

    ``y`` must be zeroed by the caller (the split-K parts are atomically added). Entries past a
    slot's rank and rows of pairs in no block are untouched.

    Args:
        a_in: [rows, K_dim], dtype of ``pool``; any strides.
        pool: [P] 1-D contiguous flat pool.
        a_offsets: int64 [S, E, R_max] or [NS, S, E, R_max].
        ranks: int32 [S].
        align: from ``moe_align_block_size(topk_ids, E, BLOCK_M, token_slots=, num_slots=S)``.
        y: float32 [NS, num_pairs, R_max] (or [num_pairs, R_max] with 3-D offsets). Accumulated.
        rows_div: pair p reads row ``p // rows_div`` of ``a_in`` (K for x, 1 for h).
        config: keys of ``moe_lora_shrink_config``; BLOCK_M must equal ``align.block_m``.
    """
    args = check_shrink_args(a_in, pool, a_offsets, ranks, y, align.num_pairs)
    a4, y3 = args.offsets, args.y
    num_slices, num_slots, num_experts, max_rank = a4.shape
    k_size = a_in.shape[1]
    cfg = dict(
        config or moe_lora_shrink_config(align.num_pairs, num_experts, k_size, max_rank, num_slices, align.block_m)
    )
    _check_lora_align(align, num_slots, num_experts, cfg["BLOCK_M"])
    if align.max_blocks == 0 or max_rank == 0 or k_size == 0:
        return y
    num_r_blocks = cdiv(max_rank, cfg["BLOCK_R"])
    grid = (align.max_blocks, cfg["SPLIT_K"], num_slices * num_r_blocks)
    _moe_lora_shrink_kernel[grid](
        a_in, pool, a4, ranks,
        align.sorted_pair_ids, align.block_expert_ids, align.num_tokens_post_padded, y3,
        align.num_pairs, num_experts, k_size, rows_div,
        a_in.stride(0), a_in.stride(1),
        a4.stride(0), a4.stride(1), a4.stride(2), a4.stride(3),
        y3.stride(0), y3.stride(1), y3.stride(2),
        NUM_R_BLOCKS=num_r_blocks,
        DOT_PRECISION="ieee",
        **cfg,
    )  # fmt: skip
    return y


def moe_lora_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    align: MoeAlignment,
    out: torch.Tensor,
    *,
    topk_weights: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """MoE-LoRA expand over virtual-expert blocks, added in place into the expert GEMM output.

    Semantics::

        W = out.shape[1] // NS                                      # slice width
        for each block b of align, v = block_expert_ids[b], s, e = v // E, v % E:
            for each pair p of block b (not padding), for i in range(NS):
                r = ranks[s]
                Bt = stack([pool[b_offsets[i, s, e, k] : ... + W] for k in range(r)])   # [r, W]
                d = scalings[s] * (y[i, p, :r] @ Bt.float())
                if topk_weights is not None:
                    d *= topk_weights.flatten()[p]
                out[p, i * W : (i + 1) * W] += d                    # fp32 add, one cast

    Rows of pairs in no block (slot -1) are untouched.

    Args:
        y: float32 [NS, num_pairs, R_max] (or [num_pairs, R_max]): shrink output.
        pool: [P] 1-D contiguous flat pool (fp16/bf16/fp32).
        b_offsets: int64 [S, E, R_max] or [NS, S, E, R_max]: rows of B^T.
        ranks: int32 [S]; scalings: float32 [S].
        align: the virtual-expert alignment the shrink used.
        out: [num_pairs, NS * W], any float dtype and strides. Modified in place.
        topk_weights: optional fp32 [T, K]: multiply the delta of pair p by its routing weight.
        config: keys of ``moe_lora_expand_config``; BLOCK_M must equal ``align.block_m``.
    """
    args = check_expand_args(y, pool, b_offsets, ranks, scalings, out, topk_weights, align.num_pairs)
    b4, y3, rw, slice_width = args.offsets, args.y, args.routed_weights, args.slice_width
    num_slices, num_slots, num_experts, max_rank = b4.shape
    cfg = dict(config or moe_lora_expand_config(slice_width, max_rank, align.block_m))
    _check_lora_align(align, num_slots, num_experts, cfg["BLOCK_M"])
    if align.max_blocks == 0 or max_rank == 0 or slice_width == 0:
        return out
    num_n_blocks = cdiv(slice_width, cfg["BLOCK_N"])
    grid = (align.max_blocks, num_slices * num_n_blocks)
    _moe_lora_expand_kernel[grid](
        y3, pool, b4, ranks, scalings,
        align.sorted_pair_ids, align.block_expert_ids, align.num_tokens_post_padded, rw, out,
        align.num_pairs, num_experts, slice_width,
        y3.stride(0), y3.stride(1), y3.stride(2),
        b4.stride(0), b4.stride(1), b4.stride(2), b4.stride(3),
        out.stride(0), out.stride(1),
        NUM_N_BLOCKS=num_n_blocks,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION="ieee",
        **cfg,
    )  # fmt: skip
    return out

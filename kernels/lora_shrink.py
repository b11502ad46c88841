"""LoRA shrink: project the layer input onto each token's adapter A (x @ A^T), paged adapter rows.

Two launch forms share the launcher ``lora_shrink``:

* BGMV (decode): one program per (token, rank block, slice); every token may use a different
  slot. Each program reads x[t] once per K chunk and the rank rows of its slot once.
* SGMV (prefill): tokens grouped by slot into segments (``kernels.lora_meta.build_segments``);
  one program per (segment, row block, slice x rank block) computes a tl.dot tile, so a block of
  BLOCK_M tokens reads its adapter's rows once.

Adapter rows live in the flat ``pool``: row k of A for slot s starts at pool element
``a_row_offsets[slice, s, k]`` and is ``in_features`` long and contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_meta import FLOAT_DTYPES, SegmentMeta, check_segments, check_shape, check_tensor

__all__ = ["lora_shrink", "shrink_config"]


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_shrink_bgmv_kernel(
    # pointers
    x_ptr,  # [T, IN], pool dtype
    pool_ptr,  # flat pool
    a_row_offsets_ptr,  # int64 [NS, S, R_MAX]
    ranks_ptr,  # int32 [NS, S]
    token_slots_ptr,  # int32 [T]
    out_ptr,  # fp32 [NS, T, R_MAX]
    # sizes
    num_tokens,
    in_features,
    max_rank,
    # strides
    stride_xm,
    stride_xk,
    stride_as,
    stride_aslot,
    stride_ar,
    stride_rs,
    stride_rslot,
    stride_os,
    stride_om,
    stride_or,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    slice_id = tl.program_id(2)
    if pid_m >= num_tokens:
        return
    slot = tl.load(token_slots_ptr + pid_m)
    if slot < 0:
        return  # base-only token: its output row stays untouched
    token = pid_m.to(tl.int64)
    slot = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot * stride_rslot)

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if pid_r * BLOCK_R < rank:
        row_offs = tl.load(
            a_row_offsets_ptr + slice_id * stride_as + slot * stride_aslot + offs_r * stride_ar,
            mask=r_mask,
            other=0,
        ).to(tl.int64)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(x_ptr + token * stride_xm + offs_k * stride_xk, mask=k_mask, other=0.0)
            a = tl.load(
                pool_ptr + row_offs[:, None] + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    # columns rank <= k < R_MAX of this token's row are written as zero
    tl.store(
        out_ptr + slice_id * stride_os + token * stride_om + offs_r * stride_or,
        acc,
        mask=offs_r < max_rank,
    )


@triton.jit(do_not_specialize=["num_segments"])
def _lora_shrink_sgmv_kernel(
    # pointers
    x_ptr,  # [T, IN], pool dtype
    pool_ptr,  # flat pool
    a_row_offsets_ptr,  # int64 [NS, S, R_MAX]
    ranks_ptr,  # int32 [NS, S]
    token_order_ptr,  # int32 [N]: token indices sorted by slot
    seg_starts_ptr,  # int32 [num_segments + 1]
    seg_slots_ptr,  # int32 [num_segments]
    out_ptr,  # fp32 [NS, T, R_MAX]
    # sizes
    num_segments,
    in_features,
    max_rank,
    # strides
    stride_xm,
    stride_xk,
    stride_as,
    stride_aslot,
    stride_ar,
    stride_rs,
    stride_rslot,
    stride_os,
    stride_om,
    stride_or,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_R_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    slice_id = tl.program_id(2) // NUM_R_BLOCKS
    pid_r = tl.program_id(2) % NUM_R_BLOCKS
    if pid_seg >= num_segments:
        return
    slot = tl.load(seg_slots_ptr + pid_seg)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    seg_end = tl.load(seg_starts_ptr + pid_seg + 1)
    row_start = tl.load(seg_starts_ptr + pid_seg) + pid_m * BLOCK_M
    if row_start >= seg_end:
        return  # this segment is shorter than the longest one
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot * stride_rslot)

    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    tokens = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if pid_r * BLOCK_R < rank:
        row_offs = tl.load(
            a_row_offsets_ptr + slice_id * stride_as + slot * stride_aslot + offs_r * stride_ar,
            mask=r_mask,
            other=0,
        ).to(tl.int64)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(
                x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            a = tl.load(
                pool_ptr + row_offs[:, None] + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            acc += tl.dot(x.to(a.dtype), tl.trans(a), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + slice_id * stride_os + tokens[:, None] * stride_om + offs_r[None, :] * stride_or,
        acc,
        mask=m_mask[:, None] & (offs_r < max_rank)[None, :],
    )


def shrink_config(
    num_tokens: int, in_features: int, max_rank: int, segmented: bool, max_seg_len: int = 0
) -> dict[str, int]:
    """Block sizes for ``lora_shrink`` (a plain heuristic; tl.dot tiles stay >= 16)."""
    block_k = min(256, max(16, triton.next_power_of_2(in_features)))
    if not segmented:
        return {"BLOCK_R": min(16, triton.next_power_of_2(max_rank)), "BLOCK_K": block_k, "num_warps": 4}
    block_m = 16 if max_seg_len <= 16 else (32 if max_seg_len <= 32 else 64)
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    return {"BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": min(block_k, 128 if block_m < 64 else 64),
            "num_warps": 4}


def lora_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_row_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    segments: SegmentMeta | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """LoRA shrink over paged adapter rows, one launch for all slices (BGMV or SGMV).

    Semantics::

        for i in range(num_slices):
            for t in range(T):
                s = token_slots[t]
                if s < 0:
                    continue                                   # out[i, t, :] untouched
                r = ranks[i, s]
                A = stack([pool[a_row_offsets[i, s, k] : a_row_offsets[i, s, k] + in_features]
                           for k in range(r)])                 # [r, in_features]
                out[i, t, :r] = A.float() @ x[t].float()
                out[i, t, r:] = 0

    Without ``segments`` each token is its own program (BGMV, for decode). With ``segments``
    (from ``build_segments(token_slots)``) tokens sharing a slot are computed as tl.dot tiles
    (SGMV, for prefill); the result is the same. Work stops at each slot's rank (rounded up to
    BLOCK_R), and tokens with slot -1 cost nothing.

    Args:
        x: [T, in_features], dtype of ``pool`` (fp16/bf16/fp32). Any strides.
        pool: [P], 1-D contiguous flat pool holding the adapter rows.
        a_row_offsets: int64 [num_slices, S, R_max] (or [S, R_max] for one slice): pool element
            offset of rank row k of A for slot s; entries k >= ranks[., s] are not read (fill -1).
        ranks: int32 [num_slices, S] (or [S]): rank of each slot, 1..R_max.
        token_slots: int32 [T]: slot of each token, -1 = no adapter.
        out: float32 [num_slices, T, R_max] (or [T, R_max]). Modified in place: rows of tokens
            with an adapter are fully written (zero past the rank); rows with slot -1 untouched.
        segments: optional SegmentMeta built from this ``token_slots``: use the SGMV form.
        config: optional block-size override (keys as returned by ``shrink_config``).

    Returns:
        ``out``.
    """
    check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2)
    device = x.device
    check_tensor("pool", pool, dtype=x.dtype, dims=1, device=device)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    check_tensor("a_row_offsets", a_row_offsets, dtype=torch.int64, dims=(2, 3), device=device)
    single = a_row_offsets.dim() == 2
    if single:
        a_row_offsets = a_row_offsets.unsqueeze(0)
    num_slices, num_slots, max_rank = a_row_offsets.shape
    num_tokens, in_features = x.shape
    check_tensor("ranks", ranks, dtype=torch.int32, dims=1 if single else 2, device=device)
    check_tensor("token_slots", token_slots, dtype=torch.int32, dims=1, device=device)
    check_tensor("out", out, dtype=torch.float32, dims=2 if single else 3, device=device)
    ranks3 = ranks.unsqueeze(0) if single else ranks
    out3 = out.unsqueeze(0) if single else out
    check_shape("ranks", ranks3, (num_slices, num_slots))
    check_shape("token_slots", token_slots, (num_tokens,))
    check_shape("out", out3, (num_slices, num_tokens, max_rank))
    if num_tokens == 0 or max_rank == 0 or num_slots == 0:
        return out

    strides = (
        x.stride(0), x.stride(1),
        a_row_offsets.stride(0), a_row_offsets.stride(1), a_row_offsets.stride(2),
        ranks3.stride(0), ranks3.stride(1),
        out3.stride(0), out3.stride(1), out3.stride(2),
    )  # fmt: skip
    if segments is None:
        cfg = dict(config or shrink_config(num_tokens, in_features, max_rank, segmented=False))
        grid = (num_tokens, triton.cdiv(max_rank, cfg["BLOCK_R"]), num_slices)
        _lora_shrink_bgmv_kernel[grid](
            x, pool, a_row_offsets, ranks3, token_slots, out3,
            num_tokens, in_features, max_rank,
            *strides,
            **cfg,
        )  # fmt: skip
        return out

    check_segments(segments, num_tokens, device)
    if segments.num_segments == 0:
        return out
    cfg = dict(config or shrink_config(num_tokens, in_features, max_rank, True, segments.max_seg_len))
    num_r_blocks = triton.cdiv(max_rank, cfg["BLOCK_R"])
    grid = (segments.num_segments, triton.cdiv(segments.max_seg_len, cfg["BLOCK_M"]), num_slices * num_r_blocks)
    _lora_shrink_sgmv_kernel[grid](
        x, pool, a_row_offsets, ranks3,
        segments.token_order, segments.seg_starts, segments.seg_slots, out3,
        segments.num_segments, in_features, max_rank,
        *strides,
        NUM_R_BLOCKS=num_r_blocks,
        DOT_PRECISION="ieee",
        **cfg,
    )  # fmt: skip
    return out

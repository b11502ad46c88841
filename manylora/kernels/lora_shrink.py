"""LoRA shrink: project the layer input onto each token's adapter A (x @ A^T), paged adapter rows.

Two launch forms share the launcher ``lora_shrink``:

* BGMV (decode): one program per (token, K split, slice x rank block); every token may use a
  different slot. Each program reads its K chunk of x[t] and of its slot's rank rows once.
* SGMV (prefill): tokens grouped by slot into segments (``manylora.kernels.lora_meta.build_segments``),
  segments cut into tiles of BLOCK_M rows; one program per (tile, slice x rank block x K split)
  computes a tl.dot tile, so a block of BLOCK_M tokens reads its adapter's rows once, and no
  program is launched for rows a short segment lacks.

Both split K (``in_features``) across programs when the grid would otherwise be small (decode:
few tokens, 4096+ long rows): partial sums are added into the fp32 output with atomics.

Adapter rows live in the flat ``pool``: row k of A for slot s starts at pool element
``a_row_offsets[slice, s, k]`` and is ``in_features`` long and contiguous. A program whose rows all
start on 16 bytes (the engine's paged layout) takes a path where the compiler is told so and reads
16 bytes an instruction; other layouts take the same code without the promise
(``python -m perf.kernels.compile_report`` shows the instructions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_config import grid_split, shrink_config, shrink_meta
from manylora.kernels.lora_meta import FLOAT_DTYPES, SegmentMeta, check_segments, check_shape, check_tensor
from manylora.kernels.relaunch import Relauncher, relauncher

__all__ = ["ShrinkLaunch", "lora_shrink", "prepare_shrink"]

# Values that change from step to step (token and segment counts, strides that follow the number
# of tokens or of adapter slots, K splits) and table pointers whose 16-byte alignment follows the
# slot count: specialising on them (== 1, % 16, alignment) would compile new variants while serving.
_VARYING_INTS = ["num_tokens", "k_split_len", "split_k", "stride_as", "stride_rs", "stride_os"]
_VARYING_POINTERS = ["a_row_offsets_ptr", "ranks_ptr", "tiles_ptr"]


@triton.jit
def _bgmv_rows_dot(
    x_row, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end, in_features,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_R]: sum over k in [k_start, k_end) of pool[row_offs + k] * x_row[k]."""
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_row + offs_k * stride_xk)
            a = tl.load(pool_ptr + row_offs[:, None] + offs_k[None, :], mask=r_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < in_features
            x = tl.load(x_row + offs_k * stride_xk, mask=k_mask, other=0.0)
            a = tl.load(
                pool_ptr + row_offs[:, None] + offs_k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    return acc


@triton.jit
def bgmv_rows_dot(
    x_row, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end, in_features,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr,
):  # fmt: skip
    """``_bgmv_rows_dot``, where rows that all start on 16 bytes (the paged layout) get vectorised loads:
    (o // A) * A == o there, and tells the compiler so; other layouts take the same loop without the promise.
    Shared with the MoE-LoRA pair kernels (manylora/kernels/moe_lora_pairs.py)."""
    if tl.sum((row_offs % ROW_ALIGN != 0).to(tl.int32), axis=0) == 0:
        aligned = (row_offs // ROW_ALIGN) * ROW_ALIGN
        acc = _bgmv_rows_dot(x_row, stride_xk, pool_ptr, aligned, r_mask, k_start, k_end, in_features,
                             BLOCK_R, BLOCK_K, EVEN_K)  # fmt: skip
    else:
        acc = _bgmv_rows_dot(x_row, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end, in_features,
                             BLOCK_R, BLOCK_K, EVEN_K)  # fmt: skip
    return acc


@triton.jit
def _sgmv_rows_dot(
    x_ptr, tokens, m_mask, stride_xm, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end, in_features,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_R]: x[tokens, k_start:k_end] @ A[rows, k_start:k_end]^T."""
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x_mask = m_mask[:, None]
            a_mask = r_mask[:, None]
        else:
            k_mask = offs_k < in_features
            x_mask = m_mask[:, None] & k_mask[None, :]
            a_mask = r_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_mask, other=0.0)
        a = tl.load(pool_ptr + row_offs[:, None] + offs_k[None, :], mask=a_mask, other=0.0)
        acc += tl.dot(x.to(a.dtype), tl.trans(a), input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
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
    k_split_len,  # elements of K per split (a multiple of BLOCK_K)
    split_k,  # programs along K (grid axis 1); a runtime value, so no recompilation per step size
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
    NUM_R_BLOCKS: tl.constexpr,
    ATOMIC: tl.constexpr,  # split_k > 1: partial sums are added into the zeroed output
    EVEN_K: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # elements in 16 bytes of the pool dtype
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slice_id = tl.program_id(2) // NUM_R_BLOCKS
    pid_r = tl.program_id(2) % NUM_R_BLOCKS
    if pid_m >= num_tokens:
        return
    token = pid_m.to(tl.int64)
    slot = tl.load(token_slots_ptr + pid_m).to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + tl.maximum(slot, 0) * stride_rslot)
    rank = tl.where(slot >= 0, rank, 0)  # base-only token: nothing to read, its row is zero

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    row_offs = tl.load(
        a_row_offsets_ptr + slice_id * stride_as + tl.maximum(slot, 0) * stride_aslot + offs_r * stride_ar,
        mask=r_mask,
        other=0,
    ).to(tl.int64)
    k_start = tl.multiple_of(pid_k * k_split_len, BLOCK_K)  # k_split_len is a multiple of BLOCK_K
    k_end = tl.minimum(k_start + k_split_len, in_features)
    k_end = tl.where(pid_r * BLOCK_R < rank, k_end, k_start)  # rank block past the slot's rank: skip
    acc = bgmv_rows_dot(x_ptr + token * stride_xm, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end,
                        in_features, BLOCK_R, BLOCK_K, EVEN_K, ROW_ALIGN)  # fmt: skip
    out_ptrs = out_ptr + slice_id * stride_os + token * stride_om + offs_r * stride_or
    if not ATOMIC:
        # the whole row is written here: zeros past the rank and on base-only tokens
        tl.store(out_ptrs, acc, mask=offs_r < max_rank)
    else:
        # fp32 partial sums into the row the launcher zeroed
        tl.atomic_add(out_ptrs, acc, mask=r_mask, sem="relaxed")


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def _lora_shrink_sgmv_kernel(
    # pointers
    x_ptr,  # [T, IN], pool dtype
    pool_ptr,  # flat pool
    a_row_offsets_ptr,  # int64 [NS, S, R_MAX]
    ranks_ptr,  # int32 [NS, S]
    token_order_ptr,  # int32 [N]: token indices sorted by slot
    seg_starts_ptr,  # int32 [num_segments + 1]
    seg_slots_ptr,  # int32 [num_segments]
    tiles_ptr,  # int32 [num_tiles, 2]: (segment, first row in token_order) of each BLOCK_M-row tile
    out_ptr,  # fp32 [NS, T, R_MAX], zeroed by the launcher
    # sizes
    in_features,
    k_split_len,  # elements of K per split (a multiple of BLOCK_K)
    split_k,  # K splits, folded into grid axis 2; a runtime value
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
    ATOMIC: tl.constexpr,  # split_k > 1
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # elements in 16 bytes of the pool dtype
):
    # axis 0 (fastest): the slices, rank blocks and K splits of one tile, so that the programs reading
    # the same rows of x run together and share them through L2; axis 1: the tile
    pid_k = tl.program_id(0) % split_k
    pid_sr = tl.program_id(0) // split_k
    slice_id = pid_sr // NUM_R_BLOCKS
    pid_r = pid_sr % NUM_R_BLOCKS
    tile = tl.program_id(1).to(tl.int64)
    seg = tl.load(tiles_ptr + 2 * tile)
    row_start = tl.load(tiles_ptr + 2 * tile + 1)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot * stride_rslot)
    if pid_r * BLOCK_R >= rank:
        return  # rank block past the slot's rank: the zeroed output stays zero

    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    tokens = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    row_offs = tl.load(
        a_row_offsets_ptr + slice_id * stride_as + slot * stride_aslot + offs_r * stride_ar,
        mask=r_mask,
        other=0,
    ).to(tl.int64)
    k_start = tl.multiple_of(pid_k * k_split_len, BLOCK_K)  # k_split_len is a multiple of BLOCK_K
    k_end = tl.minimum(k_start + k_split_len, in_features)
    if tl.sum((row_offs % ROW_ALIGN != 0).to(tl.int32), axis=0) == 0:  # as in the BGMV kernel
        row_offs = (row_offs // ROW_ALIGN) * ROW_ALIGN
        acc = _sgmv_rows_dot(x_ptr, tokens, m_mask, stride_xm, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end,
                             in_features, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, DOT_PRECISION)  # fmt: skip
    else:
        acc = _sgmv_rows_dot(x_ptr, tokens, m_mask, stride_xm, stride_xk, pool_ptr, row_offs, r_mask, k_start, k_end,
                             in_features, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, DOT_PRECISION)  # fmt: skip
    out_ptrs = out_ptr + slice_id * stride_os + tokens[:, None] * stride_om + offs_r[None, :] * stride_or
    out_mask = m_mask[:, None] & r_mask[None, :]
    if not ATOMIC:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


@dataclass(frozen=True)
class ShrinkLaunch:
    """A checked ``lora_shrink`` launch (``prepare_shrink``): the form, grid, block sizes and K split for tensors
    of the shapes, dtypes and device it was prepared with. ``launch`` checks nothing: a step prepares each
    projection group's launch once and launches it for every layer with that layer's views of the same tables
    (the checks, the heuristic and the grid arithmetic cost more host time than the launch itself)."""

    grid: tuple[int, ...]  # () when there is nothing to launch
    meta: dict[str, object]  # the kernel's compile-time parameters
    k_split_len: int
    split_k: int
    zero_out: bool  # zero ``out`` before the kernel adds into it (or instead of it, with an empty grid)
    single: bool  # 2-D tables and output (one slice)
    segments: SegmentMeta | None = None
    tiles: torch.Tensor | None = None
    relaunch: Relauncher | None = None  # the kernel with ``meta``: launches after the first skip Triton's dispatch

    def launch(self, x: torch.Tensor, pool: torch.Tensor, a_row_offsets: torch.Tensor, ranks: torch.Tensor,
               token_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``lora_shrink``'s semantics for these tensors (shaped as the prepared ones); returns ``out``."""
        if self.zero_out:
            out.zero_()
        if not self.grid:
            return out
        if self.single:
            a_row_offsets, ranks, out3 = a_row_offsets.unsqueeze(0), ranks.unsqueeze(0), out.unsqueeze(0)
        else:
            out3 = out
        strides = (
            x.stride(0), x.stride(1),
            a_row_offsets.stride(0), a_row_offsets.stride(1), a_row_offsets.stride(2),
            ranks.stride(0), ranks.stride(1),
            out3.stride(0), out3.stride(1), out3.stride(2),
        )  # fmt: skip
        num_tokens, in_features = x.shape
        if self.segments is None:
            self.relaunch(
                self.grid, x, pool, a_row_offsets, ranks, token_slots, out3,
                num_tokens, in_features, a_row_offsets.shape[2], self.k_split_len, self.split_k, *strides,
            )  # fmt: skip
        else:
            seg = self.segments
            self.relaunch(
                self.grid, x, pool, a_row_offsets, ranks, seg.token_order, seg.seg_starts, seg.seg_slots, self.tiles,
                out3, in_features, self.k_split_len, self.split_k, *strides,
            )  # fmt: skip
        return out


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
    out_is_zero: bool = False,
) -> torch.Tensor:
    """LoRA shrink over paged adapter rows, one launch for all slices (BGMV or SGMV).

    Semantics::

        for i in range(num_slices):
            for t in range(T):
                s = token_slots[t]
                out[i, t, :] = 0                               # every row is overwritten
                if s < 0:
                    continue                                   # base-only token: row stays zero
                r = ranks[i, s]
                A = stack([pool[a_row_offsets[i, s, k] : a_row_offsets[i, s, k] + in_features]
                           for k in range(r)])                 # [r, in_features]
                out[i, t, :r] = A.float() @ x[t].float()

    Without ``segments`` each token is its own program (BGMV, for decode). With ``segments``
    (from ``build_segments(token_slots)``) tokens sharing a slot are computed as tl.dot tiles
    (SGMV, for prefill); the result is the same. Work stops at each slot's rank (rounded up to
    BLOCK_R), and tokens with slot -1 read nothing.

    Split-K: ``in_features`` is cut into ``SPLIT_K`` chunks (``shrink_config`` picks it so the
    grid fills the GPU at decode sizes); each program reduces one chunk and ``tl.atomic_add``s
    its fp32 partial sums into ``out``. The launcher then zeroes ``out`` first (``out.zero_()``, a
    memset: graph-safe); it does so for the SGMV form too, where slot -1 tokens have no
    program. With one split the BGMV kernel stores whole rows itself and nothing is zeroed.
    ``out_is_zero=True`` says the caller already zeroed ``out`` (one memset per step for every
    layer's output, instead of one node per call in a decode step's graph).
    Either way ``out`` is fully overwritten and rows of slot -1 tokens come back zero. fp32
    atomics make the low bits of the result depend on the order the splits land in.
    Nothing here synchronises with the host or allocates: the launcher can be captured in a
    CUDA graph (without ``segments``; ``build_segments`` reads back to the host).

    ``lora_shrink(...)`` is ``prepare_shrink(...).launch(...)`` with the same tensors: callers that launch the
    same shapes many times (every layer of a step) prepare once.

    Args:
        x: [T, in_features], dtype of ``pool`` (fp16/bf16/fp32). Any strides.
        pool: [P], 1-D contiguous flat pool holding the adapter rows.
        a_row_offsets: int64 [num_slices, S, R_max] (or [S, R_max] for one slice): pool element
            offset of rank row k of A for slot s; entries k >= ranks[., s] are not read (fill -1).
        ranks: int32 [num_slices, S] (or [S]): rank of each slot, 1..R_max.
        token_slots: int32 [T]: slot of each token, -1 = no adapter.
        out: float32 [num_slices, T, R_max] (or [T, R_max]). Overwritten: rows of tokens with
            an adapter hold the projection (zero past the rank), rows with slot -1 are zero.
            Any strides.
        segments: optional SegmentMeta built from this ``token_slots``: use the SGMV form.
        config: optional override of ``shrink_config``'s keys (BLOCK_R, BLOCK_K, BLOCK_M,
            SPLIT_K, num_warps); keys left out take the heuristic's value.
        out_is_zero: ``out`` holds zeros already: the launcher does not zero it.

    Returns:
        ``out``.
    """
    prepared = prepare_shrink(x, pool, a_row_offsets, ranks, token_slots, out, segments=segments, config=config,
                              out_is_zero=out_is_zero)
    return prepared.launch(x, pool, a_row_offsets, ranks, token_slots, out)


def prepare_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_row_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    segments: SegmentMeta | None = None,
    config: dict[str, int] | None = None,
    out_is_zero: bool = False,
) -> ShrinkLaunch:
    """Check ``lora_shrink``'s arguments and choose its launch (see ``lora_shrink`` for them); nothing runs."""
    check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2)
    device = x.device
    check_tensor("pool", pool, dtype=x.dtype, dims=1, device=device)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    check_tensor("a_row_offsets", a_row_offsets, dtype=torch.int64, dims=(2, 3), device=device)
    single = a_row_offsets.dim() == 2
    a3 = a_row_offsets.unsqueeze(0) if single else a_row_offsets
    num_slices, num_slots, max_rank = a3.shape
    num_tokens, in_features = x.shape
    check_tensor("ranks", ranks, dtype=torch.int32, dims=1 if single else 2, device=device)
    check_tensor("token_slots", token_slots, dtype=torch.int32, dims=1, device=device)
    check_tensor("out", out, dtype=torch.float32, dims=2 if single else 3, device=device)
    check_shape("ranks", ranks.unsqueeze(0) if single else ranks, (num_slices, num_slots))
    check_shape("token_slots", token_slots, (num_tokens,))
    check_shape("out", out.unsqueeze(0) if single else out, (num_slices, num_tokens, max_rank))
    nothing = ShrinkLaunch((), {}, 0, 0, zero_out=False, single=single)
    if num_tokens == 0 or max_rank == 0:
        return nothing
    if num_slots == 0 or in_features == 0:
        return dataclasses.replace(nothing, zero_out=True)
    row_align = 16 // pool.element_size()
    if segments is None:
        cfg = shrink_config(num_tokens, in_features, max_rank, segmented=False, num_slices=num_slices)
        cfg.update(config or {})
        num_r_blocks, k_split_len, split_k = grid_split(cfg, in_features, max_rank)
        meta = {**shrink_meta(cfg), "NUM_R_BLOCKS": num_r_blocks, "EVEN_K": in_features % cfg["BLOCK_K"] == 0,
                "ROW_ALIGN": row_align}
        return ShrinkLaunch((num_tokens, split_k, num_slices * num_r_blocks), meta, k_split_len, split_k,
                            zero_out=split_k > 1 and not out_is_zero, single=single,
                            relaunch=relauncher(_lora_shrink_bgmv_kernel, **meta))

    check_segments(segments, num_tokens, device)
    if segments.num_segments == 0:  # slot -1 tokens only: no program; their rows are zero
        return dataclasses.replace(nothing, zero_out=not out_is_zero)
    cfg = shrink_config(num_tokens, in_features, max_rank, True, segments.max_seg_len, num_slices,
                        segments.config_segments())  # fmt: skip
    cfg.update(config or {})
    num_r_blocks, k_split_len, split_k = grid_split(cfg, in_features, max_rank)
    tiles = segments.tiles(cfg["BLOCK_M"])
    meta = {**shrink_meta(cfg, always_atomic=True), "NUM_R_BLOCKS": num_r_blocks,
            "EVEN_K": in_features % cfg["BLOCK_K"] == 0, "DOT_PRECISION": "ieee", "ROW_ALIGN": row_align}
    # slot -1 tokens have no program, and the splits add: the output starts at zero
    return ShrinkLaunch((num_slices * num_r_blocks * split_k, tiles.shape[0]), meta, k_split_len, split_k,
                        zero_out=not out_is_zero, single=single, segments=segments, tiles=tiles,
                        relaunch=relauncher(_lora_shrink_sgmv_kernel, **meta))

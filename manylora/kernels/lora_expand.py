"""LoRA expand: add scaling * (y @ B^T) into the base layer's output, paged adapter rows.

``y`` is the fp32 output of ``lora_shrink``. B [out, r] is stored transposed as r rank rows of
length ``out`` each (row k = B[:, k]), contiguous in the flat ``pool`` at
``b_row_offsets[slice, s, k]``. Slice i (q/k/v, gate/up, ...) adds into the columns
``slice_offsets[i] : slice_offsets[i + 1]`` of ``base_out``.

Two launch forms, like ``lora_shrink``: BGMV (one program per token, decode) and SGMV (tokens
grouped by slot into segments, tl.dot tiles, prefill). As there, rows on 16 bytes, and slices whose
first column and width are multiples of 16 bytes, are read and written 16 bytes an instruction. The
BGMV kernel has two bodies (``manylora/kernels/expand_tiles.py``; ``expand_config`` picks): B^T streamed row by
row (ROWS, the default), or a [BLOCK_R, BLOCK_N] tile reduced over the rank (small launches).

The BGMV form can also overwrite instead of add (``overwrite=True``): it then writes the LoRA term alone into an
fp32 buffer, zero in base-only tokens' rows, so that it can run beside the base GEMM (on the LoRA side stream of a
captured decode step) and the kernel consuming the projection's output adds it
(the engine's ``LoraDelta``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from manylora.kernels.expand_tiles import add_scaled, bgmv_expand_rows, bgmv_expand_tile, load_b_rows, rows_aligned
from manylora.kernels.lora_config import expand_config
from manylora.kernels.lora_meta import FLOAT_DTYPES, SegmentMeta, cdiv, check_segments, check_shape, check_tensor
from manylora.kernels.relaunch import Relauncher, relauncher

__all__ = ["ExpandLaunch", "lora_expand", "prepare_expand"]

# Step-to-step values (token and segment counts, strides that follow the number of tokens or of
# adapter slots) and slot-table pointers whose alignment follows the slot count: not specialised
# on, so serving compiles no new variants (see manylora/kernels/lora_shrink.py).
_VARYING_INTS = ["num_tokens", "stride_ys", "stride_bs", "stride_rs", "stride_ss"]
_VARYING_POINTERS = ["b_row_offsets_ptr", "ranks_ptr", "scalings_ptr", "tiles_ptr"]


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def _lora_expand_bgmv_kernel(
    # pointers
    y_ptr,  # fp32 [NS, T, R_MAX]
    pool_ptr,  # flat pool
    b_row_offsets_ptr,  # int64 [NS, S, R_MAX]
    ranks_ptr,  # int32 [NS, S]
    scalings_ptr,  # fp32 [NS, S]
    token_slots_ptr,  # int32 [T]
    slice_offsets_ptr,  # int32 [NS + 1]
    out_ptr,  # [T, N_TOTAL], modified in place
    # sizes
    num_tokens,
    # strides
    stride_ys,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bslot,
    stride_br,
    stride_rs,
    stride_rslot,
    stride_ss,
    stride_sslot,
    stride_om,
    stride_on,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_ALIGN: tl.constexpr,  # elements in 16 bytes of the pool dtype
    COL_ALIGN: tl.constexpr,  # elements in 16 bytes of the pool or output dtype, the more
    ROWS: tl.constexpr,  # B^T streamed row by row (bgmv_expand_rows); False: the [BLOCK_R, BLOCK_N] tile
    OVERWRITE: tl.constexpr,  # out = the LoRA term (zero for base-only tokens) instead of out += it
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slice_id = tl.program_id(2)
    if pid_m >= num_tokens:
        return
    slot = tl.load(token_slots_ptr + pid_m)
    if (slot < 0) & (not OVERWRITE):
        return  # base-only token: its output row stays untouched
    n_start = tl.load(slice_offsets_ptr + slice_id)
    n_size = tl.load(slice_offsets_ptr + slice_id + 1) - n_start
    if pid_n * BLOCK_N >= n_size:
        return  # this slice is narrower than the widest one
    token = pid_m.to(tl.int64)
    out_row = out_ptr + token * stride_om
    if slot < 0:  # OVERWRITE: a base-only token's LoRA term is zero
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        zero = tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty)
        tl.store(out_row + (n_start + offs_n).to(tl.int64) * stride_on, zero, mask=offs_n < n_size)
        return
    slot = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot * stride_rslot)
    scaling = tl.load(scalings_ptr + slice_id * stride_ss + slot * stride_sslot)

    y_row = y_ptr + slice_id * stride_ys + token * stride_ym
    b_offs_row = b_row_offsets_ptr + slice_id * stride_bs + slot * stride_bslot
    if not ROWS:  # the tile (plain loads)
        bgmv_expand_tile(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling,
                         n_start, n_size, pid_n, BLOCK_R, BLOCK_N, False, OVERWRITE)  # fmt: skip
    # a slice that starts and ends on 16 bytes (q/k/v and gate/up do) over rank rows on 16 bytes (the paged layout)
    # takes the unrolled 16-byte path, with the slice's bounds promised as (v // A) * A == v
    elif (n_start % COL_ALIGN == 0) & (n_size % COL_ALIGN == 0) & rows_aligned(b_offs_row, stride_br, rank,
                                                                                 ROW_ALIGN, BLOCK_R):
        bgmv_expand_rows(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling,
                         (n_start // COL_ALIGN) * COL_ALIGN, (n_size // COL_ALIGN) * COL_ALIGN, pid_n,
                         BLOCK_R, BLOCK_N, ROW_ALIGN, True, OVERWRITE)  # fmt: skip
    else:
        bgmv_expand_rows(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling,
                         n_start, n_size, pid_n, BLOCK_R, BLOCK_N, ROW_ALIGN, False, OVERWRITE)  # fmt: skip


@triton.jit
def _sgmv_tile(
    y_rows, stride_yr, m_mask, b_offs_row, stride_br, pool_ptr, out_rows, stride_on, rank, scaling, n_start, n_size,
    pid_n, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
):  # fmt: skip
    """A tile of BLOCK_M rows sharing one adapter (``y_rows``/``out_rows`` [BLOCK_M] row pointers), columns
    [pid_n * BLOCK_N, +BLOCK_N) of one slice: out[m, n_start + n] += scaling * y[m] . B^T[:, n]."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        y = tl.load(y_rows[:, None] + offs_r[None, :] * stride_yr, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        row_offs = tl.load(b_offs_row + offs_r * stride_br, mask=r_mask, other=0).to(tl.int64)
        b = load_b_rows(pool_ptr, row_offs, offs_n, r_mask, n_mask, ROW_ALIGN)
        # fp32 pool: exact fp32 dot; 16-bit pool: y rounded to the pool dtype, fp32 accumulation
        acc += tl.dot(y.to(b.dtype), b, input_precision=DOT_PRECISION)
    out_mask = m_mask[:, None] & n_mask[None, :]
    add_scaled(out_rows[:, None] + (n_start + offs_n).to(tl.int64)[None, :] * stride_on, out_mask, scaling, acc)


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def _lora_expand_sgmv_kernel(
    # pointers
    y_ptr,  # fp32 [NS, T, R_MAX]
    pool_ptr,  # flat pool
    b_row_offsets_ptr,  # int64 [NS, S, R_MAX]
    ranks_ptr,  # int32 [NS, S]
    scalings_ptr,  # fp32 [NS, S]
    token_order_ptr,  # int32 [N]: token indices sorted by slot
    seg_starts_ptr,  # int32 [num_segments + 1]
    seg_slots_ptr,  # int32 [num_segments]
    tiles_ptr,  # int32 [num_tiles, 2]: (segment, first row in token_order) of each BLOCK_M-row tile
    slice_offsets_ptr,  # int32 [NS + 1]
    out_ptr,  # [T, N_TOTAL], modified in place
    # strides
    stride_ys,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_bslot,
    stride_br,
    stride_rs,
    stride_rslot,
    stride_ss,
    stride_sslot,
    stride_om,
    stride_on,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_N_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    COL_ALIGN: tl.constexpr,
):
    # axis 0 (fastest): the column blocks of one tile's rows; axis 1: the tile
    slice_id = tl.program_id(0) // NUM_N_BLOCKS
    pid_n = tl.program_id(0) % NUM_N_BLOCKS
    tile = tl.program_id(1).to(tl.int64)
    seg = tl.load(tiles_ptr + 2 * tile)
    row_start = tl.load(tiles_ptr + 2 * tile + 1)
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0:
        return
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    n_start = tl.load(slice_offsets_ptr + slice_id)
    n_size = tl.load(slice_offsets_ptr + slice_id + 1) - n_start
    if pid_n * BLOCK_N >= n_size:
        return  # this slice is narrower than the widest one
    slot = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot * stride_rslot)
    scaling = tl.load(scalings_ptr + slice_id * stride_ss + slot * stride_sslot)

    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    tokens = tl.load(token_order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    y_rows = y_ptr + slice_id * stride_ys + tokens * stride_ym
    b_offs_row = b_row_offsets_ptr + slice_id * stride_bs + slot * stride_bslot
    out_rows = out_ptr + tokens * stride_om
    if (n_start % COL_ALIGN == 0) & (n_size % COL_ALIGN == 0):  # as in the BGMV kernel
        _sgmv_tile(y_rows, stride_yr, m_mask, b_offs_row, stride_br, pool_ptr, out_rows, stride_on, rank, scaling,
                   (n_start // COL_ALIGN) * COL_ALIGN, (n_size // COL_ALIGN) * COL_ALIGN, pid_n,
                   BLOCK_M, BLOCK_R, BLOCK_N, DOT_PRECISION, ROW_ALIGN)  # fmt: skip
    else:
        _sgmv_tile(y_rows, stride_yr, m_mask, b_offs_row, stride_br, pool_ptr, out_rows, stride_on, rank, scaling,
                   n_start, n_size, pid_n, BLOCK_M, BLOCK_R, BLOCK_N, DOT_PRECISION, ROW_ALIGN)  # fmt: skip


_BOUNDS_CACHE: dict[tuple, torch.Tensor] = {}


def _slice_bounds(
    slice_offsets: Sequence[int] | torch.Tensor, num_slices: int, total_cols: int, device: torch.device
) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """Device int32 [num_slices + 1] slice boundaries, the widest slice and (first, last) boundary (host ints)."""
    if isinstance(slice_offsets, torch.Tensor):
        check_tensor("slice_offsets", slice_offsets, dtype=(torch.int32, torch.int64), dims=1)
        bounds = [int(v) for v in slice_offsets.tolist()]  # host read: pass a list to avoid a sync
    else:
        bounds = [int(v) for v in slice_offsets]
    if len(bounds) == num_slices:
        bounds.append(total_cols)
    if len(bounds) != num_slices + 1:
        raise ValueError(
            f"slice_offsets must hold num_slices + 1 = {num_slices + 1} boundaries (or num_slices starts), "
            f"got {len(bounds)}"
        )
    if bounds[0] < 0 or bounds[-1] > total_cols or any(b > e for b, e in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"slice_offsets {bounds} must be non-decreasing within [0, {total_cols}] (base_out columns)")
    widest = max(e - b for b, e in zip(bounds, bounds[1:], strict=False))
    if (
        isinstance(slice_offsets, torch.Tensor)
        and slice_offsets.device == device
        and slice_offsets.dtype == torch.int32
        and slice_offsets.numel() == num_slices + 1
    ):
        return slice_offsets.contiguous(), widest, (bounds[0], bounds[-1])
    key = (tuple(bounds), device)
    cached = _BOUNDS_CACHE.get(key)
    if cached is None:  # a host-to-device copy: done once per distinct layout
        if len(_BOUNDS_CACHE) >= 256:
            _BOUNDS_CACHE.clear()
        cached = _BOUNDS_CACHE[key] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return cached, widest, (bounds[0], bounds[-1])


@dataclass(frozen=True)
class ExpandLaunch:
    """A checked ``lora_expand`` launch (``prepare_expand``): the form, grid, block sizes and slice bounds for tensors
    of the shapes, dtypes and device it was prepared with. ``launch`` checks nothing (see ``ShrinkLaunch``)."""

    grid: tuple[int, ...]  # () when there is nothing to launch
    meta: dict[str, object]  # the kernel's compile-time parameters
    bounds: torch.Tensor  # int32 [num_slices + 1] on the device
    single: bool  # 2-D y and tables (one slice)
    segments: SegmentMeta | None = None
    tiles: torch.Tensor | None = None
    relaunch: Relauncher | None = None  # the kernel with ``meta``: launches after the first skip Triton's dispatch
    zero_columns: tuple[int, int] | None = None  # overwrite with nothing to launch (no rank, no slot): these go to 0

    def launch(self, y: torch.Tensor, pool: torch.Tensor, b_row_offsets: torch.Tensor, ranks: torch.Tensor,
               scalings: torch.Tensor, token_slots: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        """``lora_expand``'s semantics for these tensors (shaped as the prepared ones); returns ``base_out``."""
        if not self.grid:
            if self.zero_columns is not None:
                base_out[:, self.zero_columns[0]:self.zero_columns[1]].zero_()
            return base_out
        if self.single:
            y, b_row_offsets = y.unsqueeze(0), b_row_offsets.unsqueeze(0)
            ranks, scalings = ranks.unsqueeze(0), scalings.unsqueeze(0)
        strides = (
            y.stride(0), y.stride(1), y.stride(2),
            b_row_offsets.stride(0), b_row_offsets.stride(1), b_row_offsets.stride(2),
            ranks.stride(0), ranks.stride(1),
            scalings.stride(0), scalings.stride(1),
            base_out.stride(0), base_out.stride(1),
        )  # fmt: skip
        if self.segments is None:
            self.relaunch(
                self.grid, y, pool, b_row_offsets, ranks, scalings, token_slots, self.bounds, base_out,
                y.shape[1], *strides,
            )  # fmt: skip
        else:
            seg = self.segments
            self.relaunch(
                self.grid, y, pool, b_row_offsets, ranks, scalings,
                seg.token_order, seg.seg_starts, seg.seg_slots, self.tiles, self.bounds, base_out, *strides,
            )  # fmt: skip
        return base_out


def lora_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_row_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    base_out: torch.Tensor,
    slice_offsets: Sequence[int] | torch.Tensor | None = None,
    *,
    segments: SegmentMeta | None = None,
    config: dict[str, int] | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """LoRA expand over paged adapter rows, added in place into the base output (BGMV or SGMV).

    Semantics::

        for i in range(num_slices):
            lo, hi = slice_offsets[i], slice_offsets[i + 1]
            for t in range(T):
                s = token_slots[t]
                if s < 0:
                    continue                                   # base_out[t] untouched
                r = ranks[i, s]
                Bt = stack([pool[b_row_offsets[i, s, k] : b_row_offsets[i, s, k] + (hi - lo)]
                            for k in range(r)])                # [r, hi - lo] = B^T
                base_out[t, lo:hi] += scalings[i, s] * (y[i, t, :r].float() @ Bt.float())

    Accumulation is fp32; each output element is read, added to and written once (cast to the
    dtype of ``base_out`` once). With ``overwrite`` (BGMV only) ``+=`` becomes ``=`` and the row of a slot -1
    token is set to 0 in every slice (columns outside the slices stay untouched; with no slot or no rank at all the
    slices are zeroed without a launch): ``base_out`` then holds the LoRA term alone, typically an fp32 buffer a later
    kernel adds. Only y[i, t, :rank] is read, so y's columns past the
    rank and rows of slot -1 tokens may hold anything. The rank loop stops at each slot's rank.

    Args:
        y: float32 [num_slices, T, R_max] (or [T, R_max] for one slice): shrink output. Any strides.
        pool: [P], 1-D contiguous flat pool (fp16/bf16/fp32) holding the adapter rows.
        b_row_offsets: int64 [num_slices, S, R_max] (or [S, R_max]): pool element offset of rank
            row k of B^T (= B[:, k], length = the slice's width) for slot s; k >= rank: not read.
        ranks: int32 [num_slices, S] (or [S]): rank of each slot, 1..R_max.
        scalings: float32 [num_slices, S] (or [S]): scaling (alpha / r) of each slot.
        token_slots: int32 [T]: slot of each token, -1 = no adapter.
        base_out: [T, sum(widths)], fp16/bf16/fp32, any strides. Modified in place.
        slice_offsets: column boundaries, ``num_slices + 1`` ints (slice i covers
            [slice_offsets[i], slice_offsets[i+1])), or ``num_slices`` starts (the last slice
            ends at base_out.shape[1]). A list is preferred: a tensor is read back to the host.
            Default: one slice covering all columns.
        segments: optional SegmentMeta built from this ``token_slots``: use the SGMV form.
        config: optional block-size override (keys as returned by ``expand_config``).
        overwrite: write the LoRA term instead of adding it (see above); not with ``segments``.

    ``lora_expand(...)`` is ``prepare_expand(...).launch(...)`` with the same tensors: callers that launch the
    same shapes many times (every layer of a step) prepare once.

    Returns:
        ``base_out``.
    """
    prepared = prepare_expand(y, pool, b_row_offsets, ranks, scalings, token_slots, base_out, slice_offsets,
                              segments=segments, config=config, overwrite=overwrite)
    return prepared.launch(y, pool, b_row_offsets, ranks, scalings, token_slots, base_out)


def prepare_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_row_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
    base_out: torch.Tensor,
    slice_offsets: Sequence[int] | torch.Tensor | None = None,
    *,
    segments: SegmentMeta | None = None,
    config: dict[str, int] | None = None,
    overwrite: bool = False,
) -> ExpandLaunch:
    """Check ``lora_expand``'s arguments and choose its launch (see ``lora_expand`` for them); nothing runs."""
    if overwrite and segments is not None:
        raise ValueError("lora_expand's overwrite form is BGMV only: pass segments=None with overwrite=True")
    check_tensor("y", y, dtype=torch.float32, dims=(2, 3))
    device = y.device
    single = y.dim() == 2
    y3 = y.unsqueeze(0) if single else y
    num_slices, num_tokens, max_rank = y3.shape
    check_tensor("pool", pool, dtype=FLOAT_DTYPES, dims=1, device=device)
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    dims = 2 if single else 3
    check_tensor("b_row_offsets", b_row_offsets, dtype=torch.int64, dims=dims, device=device)
    b3 = b_row_offsets.unsqueeze(0) if single else b_row_offsets
    num_slots = b3.shape[1]
    check_shape("b_row_offsets", b3, (num_slices, num_slots, max_rank))
    check_tensor("ranks", ranks, dtype=torch.int32, dims=dims - 1, device=device)
    check_tensor("scalings", scalings, dtype=torch.float32, dims=dims - 1, device=device)
    check_shape("ranks", ranks.unsqueeze(0) if single else ranks, (num_slices, num_slots))
    check_shape("scalings", scalings.unsqueeze(0) if single else scalings, (num_slices, num_slots))
    check_tensor("token_slots", token_slots, dtype=torch.int32, dims=1, device=device)
    check_shape("token_slots", token_slots, (num_tokens,))
    check_tensor("base_out", base_out, dtype=FLOAT_DTYPES, dims=2, device=device)
    if base_out.shape[0] != num_tokens:
        raise ValueError(f"base_out must have {num_tokens} rows (tokens of y), got shape {tuple(base_out.shape)}")
    if slice_offsets is None:
        slice_offsets = [0, base_out.shape[1]]
    bounds, max_out, columns = _slice_bounds(slice_offsets, num_slices, base_out.shape[1], device)
    nothing = ExpandLaunch((), {}, bounds, single, zero_columns=columns if overwrite else None)
    if num_tokens == 0 or max_rank == 0 or num_slots == 0 or max_out == 0:
        return nothing
    align = {"ROW_ALIGN": 16 // pool.element_size(),
             "COL_ALIGN": 16 // min(pool.element_size(), base_out.element_size())}
    if segments is None:
        cfg = dict(config or expand_config(num_tokens, max_out, max_rank, segmented=False, num_slices=num_slices))
        meta = {"ROWS": True, **cfg, **align, "OVERWRITE": overwrite}
        return ExpandLaunch((num_tokens, cdiv(max_out, cfg["BLOCK_N"]), num_slices), meta, bounds, single,
                            relaunch=relauncher(_lora_expand_bgmv_kernel, **meta))
    check_segments(segments, num_tokens, device)
    if segments.num_segments == 0:
        return nothing
    cfg = dict(config or expand_config(num_tokens, max_out, max_rank, True, segments.max_seg_len))
    num_n_blocks = cdiv(max_out, cfg["BLOCK_N"])
    tiles = segments.tiles(cfg["BLOCK_M"])
    meta = {**cfg, "NUM_N_BLOCKS": num_n_blocks, "DOT_PRECISION": "ieee", **align}
    return ExpandLaunch((num_slices * num_n_blocks, tiles.shape[0]), meta, bounds, single, segments, tiles,
                        relauncher(_lora_expand_sgmv_kernel, **meta))

"""Device functions of the LoRA expand kernels: one token's (or a tile's) columns of one slice.

Shared by the dense expand kernels (``manylora/kernels/lora_expand.py``) and the MoE-LoRA pair kernel
(``manylora/kernels/moe_lora_pairs.py``). B^T lies in the flat pool as rank rows (row k = B[:, k], contiguous),
row k of a slot at ``b_offs_row[k * stride_br]``; y is the shrink's fp32 output; every body adds
``scaling * y . B^T[:, n]`` into the output in fp32 and casts once (``add_scaled``), or with OVERWRITE stores it
(``write_scaled``: the dense BGMV expand's deferred form, whose fp32 output a later kernel adds).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["add_scaled", "bgmv_expand_rows", "bgmv_expand_tile", "load_b_rows", "rows_aligned", "write_scaled"]

@triton.jit
def load_b_rows(pool_ptr, row_offs, offs_n, r_mask, n_mask, ROW_ALIGN: tl.constexpr):
    """[BLOCK_R, BLOCK_N] tile pool[row_offs[:, None] + offs_n[None, :]] (masked rows / columns: 0).

    Rows that all start on 16 bytes (the paged layout) get vectorised loads: (o // A) * A == o there, and tells
    the compiler so; other layouts take the same load without the promise. The SGMV expand's tiles read B this
    way."""
    mask = r_mask[:, None] & n_mask[None, :]
    if tl.sum((row_offs % ROW_ALIGN != 0).to(tl.int32), axis=0) == 0:
        aligned = (row_offs // ROW_ALIGN) * ROW_ALIGN
        b = tl.load(pool_ptr + aligned[:, None] + offs_n[None, :], mask=mask, other=0.0)
    else:
        b = tl.load(pool_ptr + row_offs[:, None] + offs_n[None, :], mask=mask, other=0.0)
    return b


@triton.jit
def add_scaled(ptrs, mask, scaling, acc):
    """*ptrs += scaling * acc where mask: fp32 arithmetic, one cast to the output dtype."""
    base = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (base.to(tl.float32) + scaling * acc).to(base.dtype), mask=mask)


@triton.jit
def write_scaled(ptrs, mask, scaling, acc, OVERWRITE: tl.constexpr):
    """OVERWRITE: *ptrs = scaling * acc (cast to the output dtype); otherwise ``add_scaled``."""
    if OVERWRITE:
        tl.store(ptrs, (scaling * acc).to(ptrs.dtype.element_ty), mask=mask)
    else:
        add_scaled(ptrs, mask, scaling, acc)


@triton.jit
def bgmv_expand_tile(
    y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling, n_start, n_size, pid_n,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_Y: tl.constexpr = False, OVERWRITE: tl.constexpr = False,
):  # fmt: skip
    """One token's columns [pid_n * BLOCK_N, +BLOCK_N) of one slice: out_row[n_start + n] += scaling * y . B^T[:, n]
    (y [rank] fp32 at y_row, rank row k's pool offset at b_offs_row[k]; ROUND_Y: y rounded to the pool dtype
    first; OVERWRITE: ``=`` instead of ``+=``), a [BLOCK_R, BLOCK_N] tile of B^T reduced over the rank. Plain
    loads: with ``load_b_rows``' 16-byte path the reduction goes through shared memory, and the kernel measured ~3x
    slower on the H200 (2026-12-01, perf/results/2026-12-01-h200/2_forms, gate/up 74 against 21 us at 64 tokens x 8
    adapters). The dense BGMV expand's small launches and the MoE-LoRA pair kernel
    (manylora/kernels/moe_lora_pairs.py) use
    it."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        y = tl.load(y_row + offs_r * stride_yr, mask=r_mask, other=0.0)
        row_offs = tl.load(b_offs_row + offs_r * stride_br, mask=r_mask, other=0).to(tl.int64)
        b = tl.load(pool_ptr + row_offs[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if ROUND_Y:
            y = y.to(b.dtype)
        acc += tl.sum(y.to(tl.float32)[:, None] * b.to(tl.float32), axis=0)
    write_scaled(out_row + (n_start + offs_n).to(tl.int64) * stride_on, n_mask, scaling, acc, OVERWRITE)


@triton.jit
def rows_aligned(b_offs_row, stride_br, rank, ROW_ALIGN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Whether all ``rank`` rank rows' pool offsets (b_offs_row[k * stride_br]) sit on ROW_ALIGN elements (16
    bytes): scalar loads and ands, no reduction across threads."""
    aligned = rank > 0
    for r0 in range(0, rank, BLOCK_R):
        for j in tl.static_range(BLOCK_R):
            kc = tl.minimum(r0 + j, rank - 1)
            aligned = aligned & (tl.load(b_offs_row + kc * stride_br) % ROW_ALIGN == 0)
    return aligned


@triton.jit
def bgmv_expand_rows(
    y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling, n_start, n_size, pid_n,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr, ALIGNED: tl.constexpr,
    OVERWRITE: tl.constexpr = False,
):  # fmt: skip
    """``bgmv_expand_tile``'s semantics (out_row[n_start + n] += scaling * y . B^T[:, n] over one token's columns
    [pid_n * BLOCK_N, +BLOCK_N) of one slice), B^T streamed row by row: each rank row is one 1-D load of the
    tile's columns and the sum over the rank is each thread's own fp32 adds (the tile form loads [BLOCK_R, BLOCK_N]
    and reduces over its rank axis, which spreads rank rows over threads and, with 16-byte loads, goes through
    shared memory).

    ALIGNED (all rank rows start on 16 bytes, ``rows_aligned``, as in the paged layout, and the caller promised the
    slice's start and width to be multiples of 16 bytes): BLOCK_R rows unrolled per chunk, their offsets promised as
    (o // A) * A, so each row is read 16 bytes an instruction and the chunk's loads are all in flight at once; rows
    k >= rank load nothing. Otherwise one row at a time with plain loads (a fallback: layouts the pool never
    makes). OVERWRITE: ``=`` instead of ``+=`` (``write_scaled``)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if ALIGNED:
        for r0 in range(0, rank, BLOCK_R):
            for j in tl.static_range(BLOCK_R):
                k = r0 + j
                kc = tl.minimum(k, rank - 1)  # an index inside the tables; the row's load is masked off past the rank
                off = (tl.load(b_offs_row + kc * stride_br) // ROW_ALIGN) * ROW_ALIGN
                yk = tl.where(k < rank, tl.load(y_row + kc * stride_yr), 0.0)
                b = tl.load(pool_ptr + off + offs_n, mask=offs_n < tl.where(k < rank, n_size, 0), other=0.0)
                acc += yk * b.to(tl.float32)
    else:
        for k in range(0, rank):
            b = tl.load(pool_ptr + tl.load(b_offs_row + k * stride_br) + offs_n, mask=n_mask, other=0.0)
            acc += tl.load(y_row + k * stride_yr) * b.to(tl.float32)
    write_scaled(out_row + (n_start + offs_n).to(tl.int64) * stride_on, n_mask, scaling, acc, OVERWRITE)

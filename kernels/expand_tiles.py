"""Device functions of the LoRA expand kernels: one token's (or a tile's) columns of one slice.

Shared by the dense expand kernels (``kernels/lora_expand.py``) and the MoE-LoRA pair kernel
(``kernels/moe_lora_pairs.py``). B^T lies in the flat pool as rank rows (row k = B[:, k], contiguous),
row k of a slot at ``b_offs_row[k * stride_br]``; y is the shrink's fp32 output; every body adds
``scaling * y . B^T[:, n]`` into the output in fp32 and casts once (``add_scaled``), or with OVERWRITE stores it
(``write_scaled``: the dense BGMV expand's deferred form, whose fp32 output a later kernel adds). ``lora_term``
returns the term instead, for a consumer kernel that expands the LoRA itself (``kernels/lora_term.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "add_scaled", "bgmv_expand_rows", "bgmv_expand_tile", "expand_rows_acc", "load_b_rows", "lora_term", "rows_aligned",
    "write_scaled",
]

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
    adapters). The dense BGMV expand's small launches and the MoE-LoRA pair kernel (kernels/moe_lora_pairs.py) use
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
def expand_rows_acc(
    y_row, stride_yr, b_offs_row, stride_br, pool_ptr, rank, offs_n, n_size,
    BLOCK_R: tl.constexpr, ROW_ALIGN: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    """fp32 ``y . B^T[:, offs_n]`` for one token, B^T streamed row by row (0 at columns >= n_size): each rank row is
    one load of the columns and the sum over the rank is each thread's own fp32 adds, rank row 0 first.

    ALIGNED (all rank rows start on 16 bytes, ``rows_aligned``, as in the paged layout, and the caller promised
    n_size to be a multiple of 16 bytes): BLOCK_R rows unrolled per chunk, their offsets promised as (o // A) * A,
    so each row is read 16 bytes an instruction and the chunk's loads are all in flight at once; rows k >= rank load
    nothing. Otherwise one row at a time with plain loads (a fallback: layouts the pool never makes)."""
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
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
        n_mask = offs_n < n_size
        for k in range(0, rank):
            b = tl.load(pool_ptr + tl.load(b_offs_row + k * stride_br) + offs_n, mask=n_mask, other=0.0)
            acc += tl.load(y_row + k * stride_yr) * b.to(tl.float32)
    return acc


@triton.jit
def bgmv_expand_rows(
    y_row, stride_yr, b_offs_row, stride_br, pool_ptr, out_row, stride_on, rank, scaling, n_start, n_size, pid_n,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr, ALIGNED: tl.constexpr,
    OVERWRITE: tl.constexpr = False,
):  # fmt: skip
    """``bgmv_expand_tile``'s semantics (out_row[n_start + n] += scaling * y . B^T[:, n] over one token's columns
    [pid_n * BLOCK_N, +BLOCK_N) of one slice), B^T streamed row by row (``expand_rows_acc``; the tile form loads
    [BLOCK_R, BLOCK_N] and reduces over its rank axis, which spreads rank rows over threads and, with 16-byte loads,
    goes through shared memory). ALIGNED: also the slice's start promised a multiple of 16 bytes by the caller, so
    that the output is written 16 bytes an instruction. OVERWRITE: ``=`` instead of ``+=`` (``write_scaled``)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = expand_rows_acc(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, rank, offs_n, n_size,
                          BLOCK_R, ROW_ALIGN, ALIGNED)  # fmt: skip
    write_scaled(out_row + (n_start + offs_n).to(tl.int64) * stride_on, offs_n < n_size, scaling, acc, OVERWRITE)


@triton.jit
def lora_term(
    y_ptr, pool_ptr, b_offs_ptr, ranks_ptr, scalings_ptr, token_slots_ptr, token, slice_id, offs_n, n_size,
    stride_ys, stride_ym, stride_yr, stride_bs, stride_bslot, stride_br, stride_rs, stride_rslot, stride_ss,
    stride_sslot, BLOCK_R: tl.constexpr, ROW_ALIGN: tl.constexpr,
):  # fmt: skip
    """fp32 [offs_n's shape]: one token's LoRA term at columns ``offs_n`` of one slice, expanded where a consumer
    kernel needs it (``kernels/lora_term.LoraFactors``): ``scaling * y . B^T[:, offs_n]`` as the BGMV expand
    computes it (``expand_rows_acc``, then the scaling), 0 at columns >= n_size and for a token without an adapter
    (slot -1). ``offs_n``: columns within the slice (any shape; 16-byte reads where they run in aligned blocks)."""
    slot = tl.load(token_slots_ptr + token)
    term = tl.zeros(offs_n.shape, dtype=tl.float32)
    if slot >= 0:
        s = slot.to(tl.int64)
        rank = tl.load(ranks_ptr + slice_id * stride_rs + s * stride_rslot)
        scaling = tl.load(scalings_ptr + slice_id * stride_ss + s * stride_sslot)
        y_row = y_ptr + slice_id * stride_ys + token * stride_ym
        b_offs_row = b_offs_ptr + slice_id * stride_bs + s * stride_bslot
        if (n_size % ROW_ALIGN == 0) & rows_aligned(b_offs_row, stride_br, rank, ROW_ALIGN, BLOCK_R):
            acc = expand_rows_acc(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, rank, offs_n,
                                  (n_size // ROW_ALIGN) * ROW_ALIGN, BLOCK_R, ROW_ALIGN, True)  # fmt: skip
        else:
            acc = expand_rows_acc(y_row, stride_yr, b_offs_row, stride_br, pool_ptr, rank, offs_n, n_size,
                                  BLOCK_R, ROW_ALIGN, False)  # fmt: skip
        term = scaling * acc
    return term

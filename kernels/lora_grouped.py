"""LoRA shrink / expand for decode, grouped by adapter slot on BGMV's grid ("grouped" form).

BGMV (``kernels/lora_shrink.py``, ``kernels/lora_expand.py``) gives every token its own programs, so a slot that
serves m tokens has its adapter rows read m times (from L2 after the first): at 64 tokens and 8 adapters a q/k/v
shrink reads ~25 MB through L2 for 3 MB of adapter rows. These kernels keep BGMV's grid (token, K split or column
block, slice) and its tables, so a captured decode step launches them the same way, with nothing built per step:

* the programs of a slot's first token (its "leader": no earlier token has the slot) compute every token of that
  slot, BLOCK_M tokens at a time as a tl.dot tile, reading the adapter's rows once for all of them;
* the programs of the slot's other tokens return at once; a base-only token's (slot -1) only writes its zeros.

Tokens are scanned in blocks of BLOCK_M starting at the leader (earlier tokens cannot hold its slot); a block
with none of the slot's tokens is skipped, so with all-distinct slots each leader does one block, like BGMV.

Numerics: the shrink's products of the pool dtype in fp32 with fp32 accumulation, as BGMV. The expand's y (fp32)
is split into two parts of the pool dtype (y = hi + lo, ~16 bits of mantissa) for the tensor-core dot when the
pool is 16-bit, so it stays within fp32-order error of BGMV's fp32 y; with an fp32 pool the dot is exact fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.expand_tiles import load_b_rows, write_scaled

__all__ = ["lora_expand_grouped_kernel", "lora_shrink_grouped_kernel"]

_SHRINK_VARYING_INTS = ["num_tokens", "k_split_len", "split_k", "stride_as", "stride_rs", "stride_os"]
_EXPAND_VARYING_INTS = ["num_tokens", "stride_ys", "stride_bs", "stride_rs", "stride_ss"]
_VARYING_POINTERS = ["a_row_offsets_ptr", "b_row_offsets_ptr", "ranks_ptr", "scalings_ptr"]


@triton.jit
def slot_leader(token_slots_ptr, token, slot, SCAN: tl.constexpr):
    """Whether ``token`` is the first token holding ``slot`` (no token before it does)."""
    dup = token * 0
    for j in range(0, token, SCAN):
        offs = j + tl.arange(0, SCAN)
        s = tl.load(token_slots_ptr + offs, mask=offs < token, other=-1)
        dup += tl.sum((s == slot).to(tl.int32), axis=0)
    return dup == 0


@triton.jit
def _shrink_slot_tokens(
    x_ptr, token_slots_ptr, num_tokens, first, slot, stride_xm, stride_xk, pool_ptr, row_offs, offs_r,
    r_mask, max_rank, k_start, k_end, in_features, out_slice, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, offs_r] (+)= x[t, k_start:k_end] @ A[rows, k_start:k_end]^T for every token t >= first of ``slot``."""
    for m0 in range(first, num_tokens, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_slots = tl.load(token_slots_ptr + offs_m, mask=offs_m < num_tokens, other=-1)
        m_mask = m_slots == slot
        if tl.sum(m_mask.to(tl.int32), axis=0) > 0:
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
                x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=x_mask, other=0.0)  # fmt: skip
                a = tl.load(pool_ptr + row_offs[:, None] + offs_k[None, :], mask=a_mask, other=0.0)
                acc += tl.dot(x.to(a.dtype), tl.trans(a), input_precision=DOT_PRECISION)
            out_ptrs = out_slice + offs_m.to(tl.int64)[:, None] * stride_om + offs_r[None, :] * stride_or
            if not ATOMIC:  # whole rows: zeros past the rank
                tl.store(out_ptrs, acc, mask=m_mask[:, None] & (offs_r < max_rank)[None, :])
            else:
                tl.atomic_add(out_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :], sem="relaxed")


@triton.jit(do_not_specialize=_SHRINK_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def lora_shrink_grouped_kernel(
    x_ptr, pool_ptr, a_row_offsets_ptr, ranks_ptr, token_slots_ptr, out_ptr,
    num_tokens, in_features, max_rank, k_split_len, split_k,
    stride_xm, stride_xk, stride_as, stride_aslot, stride_ar, stride_rs, stride_rslot, stride_os, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NUM_R_BLOCKS: tl.constexpr,
    ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, ROW_ALIGN: tl.constexpr,
):  # fmt: skip
    """``lora_shrink``'s semantics (arguments and grid (T, split_k, NS * NUM_R_BLOCKS) as the BGMV kernel's), each
    slot's tokens computed by its first token's programs."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slice_id = tl.program_id(2) // NUM_R_BLOCKS
    pid_r = tl.program_id(2) % NUM_R_BLOCKS
    if pid_m >= num_tokens:
        return
    slot = tl.load(token_slots_ptr + pid_m)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    out_slice = out_ptr + slice_id * stride_os
    if slot < 0:
        if not ATOMIC:  # base-only token: its row is zero (with atomics the launcher zeroed the output)
            tl.store(out_slice + pid_m.to(tl.int64) * stride_om + offs_r * stride_or,
                     tl.zeros((BLOCK_R,), dtype=tl.float32), mask=offs_r < max_rank)  # fmt: skip
        return
    if not slot_leader(token_slots_ptr, pid_m, slot, BLOCK_M):
        return  # the slot's first token computes this one
    slot64 = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot64 * stride_rslot)
    r_mask = offs_r < rank
    row_offs = tl.load(a_row_offsets_ptr + slice_id * stride_as + slot64 * stride_aslot + offs_r * stride_ar,
                       mask=r_mask, other=0).to(tl.int64)  # fmt: skip
    k_start = tl.multiple_of(pid_k * k_split_len, BLOCK_K)  # k_split_len is a multiple of BLOCK_K
    k_end = tl.minimum(k_start + k_split_len, in_features)
    k_end = tl.where(pid_r * BLOCK_R < rank, k_end, k_start)  # rank block past the slot's rank: zeros
    if tl.sum((row_offs % ROW_ALIGN != 0).to(tl.int32), axis=0) == 0:  # rows on 16 bytes: vectorised loads
        _shrink_slot_tokens(x_ptr, token_slots_ptr, num_tokens, pid_m, slot, stride_xm, stride_xk, pool_ptr,
                            (row_offs // ROW_ALIGN) * ROW_ALIGN, offs_r, r_mask, max_rank, k_start, k_end,
                            in_features, out_slice, stride_om, stride_or, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, ATOMIC,
                            DOT_PRECISION)  # fmt: skip
    else:
        _shrink_slot_tokens(x_ptr, token_slots_ptr, num_tokens, pid_m, slot, stride_xm, stride_xk, pool_ptr,
                            row_offs, offs_r, r_mask, max_rank, k_start, k_end, in_features, out_slice, stride_om,
                            stride_or, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, ATOMIC, DOT_PRECISION)  # fmt: skip


@triton.jit
def _expand_slot_tokens(
    y_slice, stride_ym, stride_yr, token_slots_ptr, num_tokens, first, slot, b_offs_row, stride_br, pool_ptr,
    out_ptr, stride_om, stride_on, rank, scaling, n_start, n_size, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr,
    SPLIT_Y: tl.constexpr, DOT_PRECISION: tl.constexpr, OVERWRITE: tl.constexpr,
):  # fmt: skip
    """out[t, n_start + n] (+)= scaling * y[t] . B^T[:, n] over columns [pid_n * BLOCK_N, +BLOCK_N) of one slice,
    for every token t >= first of ``slot``."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size
    cols = (n_start + offs_n).to(tl.int64)
    for m0 in range(first, num_tokens, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_slots = tl.load(token_slots_ptr + offs_m, mask=offs_m < num_tokens, other=-1)
        m_mask = m_slots == slot
        if tl.sum(m_mask.to(tl.int32), axis=0) > 0:
            rows = offs_m.to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < rank
                y = tl.load(y_slice + rows[:, None] * stride_ym + offs_r[None, :] * stride_yr,
                            mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
                row_offs = tl.load(b_offs_row + offs_r * stride_br, mask=r_mask, other=0).to(tl.int64)
                b = load_b_rows(pool_ptr, row_offs, offs_n, r_mask, n_mask, ROW_ALIGN)
                if SPLIT_Y:  # 16-bit pool: y = hi + lo, both exact in the pool dtype to ~16 bits together
                    hi = y.to(b.dtype)
                    lo = (y - hi.to(tl.float32)).to(b.dtype)
                    acc += tl.dot(hi, b) + tl.dot(lo, b)
                else:
                    acc += tl.dot(y.to(b.dtype), b, input_precision=DOT_PRECISION)
            write_scaled(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
                         m_mask[:, None] & n_mask[None, :], scaling, acc, OVERWRITE)  # fmt: skip


@triton.jit(do_not_specialize=_EXPAND_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def lora_expand_grouped_kernel(
    y_ptr, pool_ptr, b_row_offsets_ptr, ranks_ptr, scalings_ptr, token_slots_ptr, slice_offsets_ptr, out_ptr,
    num_tokens,
    stride_ys, stride_ym, stride_yr, stride_bs, stride_bslot, stride_br, stride_rs, stride_rslot, stride_ss,
    stride_sslot, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr,
    COL_ALIGN: tl.constexpr, SPLIT_Y: tl.constexpr, DOT_PRECISION: tl.constexpr, OVERWRITE: tl.constexpr,
):  # fmt: skip
    """``lora_expand``'s semantics (arguments and grid (T, N blocks, NS) as the BGMV kernel's, OVERWRITE too), each
    slot's tokens computed by its first token's programs."""
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
    if slot < 0:  # OVERWRITE: a base-only token's LoRA term is zero
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + (n_start + offs_n).to(tl.int64) * stride_on,
                 tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=offs_n < n_size)  # fmt: skip
        return
    if not slot_leader(token_slots_ptr, pid_m, slot, BLOCK_M):
        return  # the slot's first token computes this one
    slot64 = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot64 * stride_rslot)
    scaling = tl.load(scalings_ptr + slice_id * stride_ss + slot64 * stride_sslot)
    y_slice = y_ptr + slice_id * stride_ys
    b_offs_row = b_row_offsets_ptr + slice_id * stride_bs + slot64 * stride_bslot
    if (n_start % COL_ALIGN == 0) & (n_size % COL_ALIGN == 0):  # slice bounds on 16 bytes: vectorised columns
        _expand_slot_tokens(y_slice, stride_ym, stride_yr, token_slots_ptr, num_tokens, pid_m, slot, b_offs_row,
                            stride_br, pool_ptr, out_ptr, stride_om, stride_on, rank, scaling,
                            (n_start // COL_ALIGN) * COL_ALIGN, (n_size // COL_ALIGN) * COL_ALIGN, pid_n,
                            BLOCK_M, BLOCK_R, BLOCK_N, ROW_ALIGN, SPLIT_Y, DOT_PRECISION, OVERWRITE)  # fmt: skip
    else:
        _expand_slot_tokens(y_slice, stride_ym, stride_yr, token_slots_ptr, num_tokens, pid_m, slot, b_offs_row,
                            stride_br, pool_ptr, out_ptr, stride_om, stride_on, rank, scaling, n_start, n_size,
                            pid_n, BLOCK_M, BLOCK_R, BLOCK_N, ROW_ALIGN, SPLIT_Y, DOT_PRECISION,
                            OVERWRITE)  # fmt: skip

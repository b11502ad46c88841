"""The base layers' GEMM for decode-sized batches: ``x @ weight^T (+ bias)`` with few rows and a K split.

A decode step multiplies 1-128 token rows by every projection's weight ([N, K], 16-64 MB in bf16 for Llama-3-8B):
the GEMM is a stream over the weight, and its speed is the share of the copy bandwidth it keeps. One program per
[BLOCK_N] column block leaves few programs for the narrow layers (q/k/v: 96 blocks of 64, o: 64, on 132 SMs), so
for few rows, where the partial sums cost little traffic, the K axis is split too (``gemm_config``): SPLIT_K
programs per column block each reduce a contiguous K range into fp32, write their partial sum to a workspace,
and the last of them to finish (an atomic counter per output tile) adds the partials in split order, adds the
bias, rounds to the output dtype and stores, then resets the counter for the next launch.
One launch, no memset, deterministic (the sum's order does not depend on which program finished last), and
CUDA-graph safe (the workspace and counters are made once per row bucket and shape, by the eager forwards that
precede a capture; a capture that would have to make one refuses instead).

Opt-in (``EngineConfig.base_gemm = "triton"``): on the H200 it is slower than cuBLAS (perf/results/2026-12-01-h200/
18_gemm: its best configs 0.95-0.97x at 64 rows; with a K split whose partials are 25% of the weight's bytes,
0.5-0.67x). ``perf/bench_gemm.py`` times both per GEMM, ``perf/bench_decode_step.py --base-gemm torch,triton`` the
whole step.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.expand_tiles import add_gemm_lora_term
from kernels.lora_config import NUM_SMS
from kernels.lora_meta import FLOAT_DTYPES, cdiv, check_shape, check_tensor
from kernels.pdl import pdl_supported
from kernels.relaunch import relauncher

__all__ = ["MAX_SKINNY_ROWS", "GemmLora", "gemm_config", "lora_block_n", "r_block", "skinny_linear"]

# Rows above which the caller should keep cuBLAS
MAX_SKINNY_ROWS = 128
# Rows of one tile: more rows take several tiles, which read each weight block from HBM once and from L2 after (a
# single 128-row tile of 32 columns re-read the batch from L2 4x the weight's bytes and ran at 0.44-0.53x of cuBLAS
# on the H200, perf/results/2026-12-01-h200/18_gemm; the 64-row tiles came within 3-5% of it)
MAX_TILE_ROWS = 64


# the batch's rows change from step to step, and the LoRA tables' strides and pointers with the rows and the slot
# count: not specialised on, so serving compiles no new variants
_VARYING_INTS = ["M", "stride_ys", "stride_ym", "stride_bs", "stride_as", "stride_ss", "num_a_programs"]
_VARYING_POINTERS = ["y_ptr", "step_rows_ptr", "a_rows_ptr", "scalings_ptr", "token_slots_ptr", "step_slots_ptr"]


@triton.jit
def _leave(sync_ptr, num_programs):
    """A program of a SHRINK launch is done: the last one resets the launch's tickets and counters."""
    finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu")
    if finished == num_programs - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")


@triton.jit
def _shrink_dot(x_rows, m_mask, pool_ptr, a_offs, live, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N]: x[rows, :K] @ A^T, column j of A^T the pool row at a_offs[j] (live[j] only)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_cols = pool_ptr + a_offs[None, :]
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            a_t = tl.load(a_cols + offs_k[:, None], mask=live[None, :], other=0.0)
        else:
            k_mask = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a_t = tl.load(a_cols + offs_k[:, None], mask=k_mask[:, None] & live[None, :], other=0.0)
        acc += tl.dot(x, a_t, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _shrink_program(ticket, x_rows, offs_m, m_mask, K, pool_ptr, a_rows_ptr, token_slots_ptr, step_slots_ptr, y_ptr,
                    num_slices, y_ranks, stride_as, stride_ys, stride_ym, stride_yr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_CHUNKS: tl.constexpr,
                    R_BLOCK: tl.constexpr, ROW_ALIGN: tl.constexpr, EVEN_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):  # fmt: skip
    """A SHRINK launch's shrink program: ``ticket`` = u * A_CHUNKS + c computes, for the step's u-th distinct slot s
    (``build_step_slots``), y[i, m, k] = x[m] . A_{i, s}[k] over BLOCK_N of its (slice i, rank row k) pairs (pairs
    c * BLOCK_N + j, i = pair // R_BLOCK, k = pair % R_BLOCK), and stores them in the rows m of slot s."""
    u = ticket // A_CHUNKS
    if u < tl.load(step_slots_ptr):
        slot = tl.load(step_slots_ptr + 2 + u)
        pairs = (ticket % A_CHUNKS) * BLOCK_N + tl.arange(0, BLOCK_N)
        slice_id = pairs // R_BLOCK
        r = pairs % R_BLOCK
        in_slices = slice_id < num_slices
        a_offs = tl.load(a_rows_ptr + slice_id * stride_as + u * R_BLOCK + r, mask=in_slices, other=-1)
        live = a_offs >= 0
        if tl.load(step_slots_ptr + 1) != 0:  # every row on 16 bytes: promised, for 16-byte copies
            acc = _shrink_dot(x_rows, m_mask, pool_ptr, (a_offs // ROW_ALIGN) * ROW_ALIGN, live, K, BLOCK_M, BLOCK_N,
                              BLOCK_K, EVEN_K, DOT_PRECISION)  # fmt: skip
        else:
            acc = _shrink_dot(x_rows, m_mask, pool_ptr, a_offs, live, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                              DOT_PRECISION)  # fmt: skip
        own = m_mask & (tl.load(token_slots_ptr + offs_m, mask=m_mask, other=-1) == slot)
        y_offs = slice_id[None, :] * stride_ys + offs_m[:, None] * stride_ym + r[None, :] * stride_yr
        tl.store(y_ptr + y_offs, acc, mask=own[:, None] & in_slices[None, :] & (r[None, :] < y_ranks))


@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    partial_ptr,  # fp32 [SPLIT_K, partial_rows, N] (SPLIT_K > 1)
    counters_ptr,  # int32 [m blocks * n blocks], zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # K elements per split, a multiple of BLOCK_K
    partial_rows,  # rows of the workspace (>= M: the batch's BLOCK_M tiles)
    # the LoRA term (HAS_LORA; GemmLora's tensors, expand_tiles.add_gemm_lora_term)
    y_ptr,  # fp32 [NS, M, R_MAX]: the shrink's output (written by this launch's shrink programs with SHRINK)
    pool_ptr,  # flat pool
    step_rows_ptr,  # int64 [NS, S * R_BLOCK]
    scalings_ptr,  # fp32 [NS, S]
    token_slots_ptr,  # int32 [M]
    step_slots_ptr,  # int32 [2 + S]
    bound_1,  # first column of slice 1 (N where there is none)
    bound_2,  # first column of slice 2 (N where there is none)
    y_ranks,  # R_MAX
    stride_ys,
    stride_ym,
    stride_yr,
    stride_bs,
    stride_ss,
    stride_sslot,
    # the shrink inside the launch (SHRINK)
    a_rows_ptr,  # int64 [NS, S * R_BLOCK]: build_step_rows of the A rows
    sync_ptr,  # int32 [3]: tickets, shrink programs done, programs done; zero between launches
    num_a_programs,  # S * A_CHUNKS
    num_slices,
    stride_as,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    DOT_PRECISION: tl.constexpr,
    HAS_LORA: tl.constexpr,
    R_BLOCK: tl.constexpr,  # the LoRA tables' R_max, rounded up to a power of two
    BLOCK_J: tl.constexpr,  # (slot, rank row) pairs of the LoRA term a chunk, a multiple of R_BLOCK
    ROW_ALIGN: tl.constexpr,  # pool elements in 16 bytes
    PDL: tl.constexpr,  # launched with programmatic dependent launch after the shrink (kernels/pdl.py)
    SHRINK: tl.constexpr,  # the shrink's programs first in this launch (one 1-D grid; the GEMM's wait for them)
    A_CHUNKS: tl.constexpr,  # shrink programs per slot
):
    if SHRINK:
        # programs take tickets in the order they start: every shrink program (the first num_a_programs tickets)
        # has started before any GEMM program, so the GEMM's wait for them below always ends
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        num_programs = tl.num_programs(0)
        if ticket < num_a_programs:
            _shrink_program(ticket, x_ptr + tl.arange(0, BLOCK_M).to(tl.int64)[:, None] * stride_xm,
                            tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_M) < M, K, pool_ptr, a_rows_ptr,
                            token_slots_ptr, step_slots_ptr, y_ptr, num_slices, y_ranks, stride_as, stride_ys,
                            stride_ym, stride_yr, BLOCK_M, BLOCK_N, BLOCK_K, A_CHUNKS, R_BLOCK, ROW_ALIGN, EVEN_K,
                            DOT_PRECISION)  # fmt: skip
            tl.debug_barrier()  # every thread's y is written before the counter says so
            tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
            _leave(sync_ptr, num_programs)
            return
        tile = ticket - num_a_programs
        pid_n = tile % tl.cdiv(N, BLOCK_N)
        pid_m = 0  # one row block (the launcher's check)
        pid_k = tile // tl.cdiv(N, BLOCK_N)
        num_n_blocks = tl.cdiv(N, BLOCK_N)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        num_n_blocks = tl.num_programs(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # weight^T's columns: [BLOCK_K, BLOCK_N] tiles
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w_t = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_t = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x, w_t, input_precision=DOT_PRECISION)

    tile_mask = m_mask[:, None] & n_mask[None, :]
    tile_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K > 1:
        split_offs = partial_rows.to(tl.int64) * N
        tl.store(partial_ptr + pid_k * split_offs + tile_offs, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        counter = counters_ptr + pid_m * num_n_blocks + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            if SHRINK:
                _leave(sync_ptr, num_programs)
            return  # not the last split of this tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT_K):  # in split order, whichever arrived last
            acc += tl.load(partial_ptr + s * split_offs + tile_offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if HAS_LORA:
        if PDL:
            tl.extra.cuda.gdc_wait()  # the shrink ahead has completed: its y is written and visible
        if SHRINK:  # this launch's shrink programs have all written their y
            while tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu") < num_a_programs:
                pass
        acc = add_gemm_lora_term(acc, offs_m, m_mask, offs_n, n_mask, pid_n * BLOCK_N, y_ptr, pool_ptr,
                                 step_rows_ptr, scalings_ptr, token_slots_ptr, step_slots_ptr, bound_1, bound_2,
                                 y_ranks, stride_ys, stride_ym, stride_yr, stride_bs, stride_ss, stride_sslot,
                                 BLOCK_M, BLOCK_N, R_BLOCK, BLOCK_J, ROW_ALIGN, DOT_PRECISION)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if SHRINK:
        _leave(sync_ptr, num_programs)


# Shared memory the pipeline's stages may take (the H100 / H200 allow 227 KB a program; the epilogue's layout
# conversion takes some of the rest). Compiled for sm_90, the 16-bit (wgmma) kernel keeps num_stages
# [BLOCK_M, BLOCK_K] + [BLOCK_K, BLOCK_N] buffers (perf/compile_report.py: 160 KB for 64 x 64 x 128 at 5 stages).
PIPELINE_SHARED_BYTES = 192 * 1024
MAX_STAGES = 5  # the H200 sweep's best at 64 rows (perf/results/2026-12-01-h200/18_gemm) took 5 of {3, 5}
# A K split writes and reads back fp32 partials: at most this share of the weight's bytes (64 rows of q/k/v with
# 4 splits, 25% more traffic, took 24.1 us against 16.5 without a split on the H200)
MAX_PARTIAL_TRAFFIC = 1 / 16


def pipeline_stages(block_m: int, block_n: int, block_k: int, element_size: int) -> int:
    """The deepest pipeline (<= MAX_STAGES, >= 2) whose operand buffers, one set a stage, fit PIPELINE_SHARED_BYTES."""
    per_stage = (block_m + block_n) * block_k * element_size
    return max(2, min(MAX_STAGES, PIPELINE_SHARED_BYTES // per_stage))


def max_k_split(block_m: int, in_features: int, element_size: int) -> int:
    """The most K splits whose partials (write + read, fp32, [split, BLOCK_M, BLOCK_N] a tile) stay within
    MAX_PARTIAL_TRAFFIC of the tile's weight bytes (BLOCK_N x in_features): 4 at 16 rows and 1 at 64 for K = 4096."""
    return max(1, int(in_features * element_size * MAX_PARTIAL_TRAFFIC) // (2 * 4 * block_m))


@functools.lru_cache(maxsize=1024)
def _gemm_config_cached(num_rows: int, out_features: int, in_features: int,
                        element_size: int) -> tuple[tuple[str, int], ...]:
    block_m = min(MAX_TILE_ROWS, max(16, triton.next_power_of_2(num_rows)))
    # fp32 takes the FMA path (no tensor cores), whose operand slices live in registers: 64 x 64 x 128 spills there
    block_k = min(128 if element_size <= 2 else 32, max(16, triton.next_power_of_2(in_features)))
    row_tiles = cdiv(num_rows, block_m)
    num_k_blocks = cdiv(in_features, block_k)
    cap = max_k_split(block_m, in_features, element_size)
    block_n = 64
    if cap == 1 and row_tiles * cdiv(out_features, 64) < 2 * NUM_SMS // 3:
        block_n = 32  # no affordable K split: narrower column blocks fill the SMs instead (64 rows of o on the H200)
    want = cdiv(2 * NUM_SMS, row_tiles * cdiv(out_features, block_n))  # about two programs per SM
    divisors = [d for d in range(1, num_k_blocks + 1) if num_k_blocks % d == 0]
    split = next((d for d in divisors if d >= want), num_k_blocks)
    split = max(d for d in divisors if d <= min(split, cap, 16))
    return (("BLOCK_M", block_m), ("BLOCK_N", block_n), ("BLOCK_K", block_k), ("SPLIT_K", split),
            ("num_warps", 4), ("num_stages", pipeline_stages(block_m, block_n, block_k, element_size)))  # fmt: skip


def gemm_config(num_rows: int, out_features: int, in_features: int, element_size: int = 2) -> dict[str, int]:
    """The launcher's block sizes, K split, warps and pipeline stages for a [num_rows, in] x [out, in]^T GEMM of
    ``element_size``-byte operands: tiles of BLOCK_M rows covering the batch; about two programs per SM through a
    K split where its partials cost little (few rows), else through narrower column blocks; as many pipeline stages
    as fit the shared memory; batches over 64 rows in several 64-row tiles. At 64 rows of Llama-3-8B's q/k/v and o
    it gives the H200 sweep's best configs (16.5 and 12.7 us, cuBLAS 16.1 and 12.1); other row counts are not
    swept yet (the 64-row cap for 128 rows is unmeasured). A fresh dict."""
    return dict(_gemm_config_cached(num_rows, out_features, in_features, element_size))


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, split: int, rows: int, cols: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials [split, rows, cols] and the zeroed int32 tile counters of one launch shape, made once: the
    last split of each tile resets its counter, so they stay valid from launch to launch (and graph replay to
    replay). ``rows`` is the batch rounded up to its BLOCK_M tiles, so that eager steps of every batch size share
    the few workspaces of their row buckets (16, 32, 64, 128). Shared by every layer of that shape: one GEMM of a
    device runs at a time on its stream."""
    key = (device, split, rows, cols, tiles)
    if key not in _WORKSPACES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # the counters' memset would only be recorded: an eager launch before the first replay would read
            # uninitialised counters (capture_forward's warm-up forwards make every workspace first)
            raise RuntimeError(f"skinny_linear: no workspace for {split} K splits x {rows} rows x {cols} columns yet; "
                               f"run the GEMM once outside CUDA-graph capture first")
        _WORKSPACES[key] = (torch.empty((split, rows, cols), dtype=torch.float32, device=device),
                            torch.zeros(tiles, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


@dataclass(frozen=True)
class GemmLora:
    """The LoRA term ``skinny_linear`` adds into its output tiles before rounding them: each row's adapter's
    ``scaling * (x @ A^T) @ B^T``, the shrink (x @ A^T) computed before by ``kernels.lora_shrink`` into ``y``.
    The tables are ``lora_expand``'s: B [out, r] stored transposed as rank rows in the flat pool.

    Attributes:
        y: fp32 [NS, M, R_max]: the shrink's output for the GEMM's M rows (zero past each row's rank is not needed).
        pool: 1-D flat pool of the GEMM's dtype.
        b_row_offsets: int64 [NS, S, R_max]: pool offset of rank row k of slice i's B^T for slot s.
        ranks: int32 [NS, S]; scalings: fp32 [NS, S].
        token_slots: int32 [M]: each row's slot, -1 = none.
        step_slots: int32 [2 + S] (``kernels.lora_meta.build_step_slots``): the distinct slots of token_slots.
        step_rows: int64 [NS, S * R_block] (``kernels.lora_meta.build_step_rows`` of b_row_offsets, ranks and
            step_slots, R_block the tables' R_max rounded up to a power of two, ``r_block``): the B rows the GEMM
            reads, listed in its order. b_row_offsets and ranks describe the same rows (the checks, the reference).
        widths: the NS slices' widths, summing to the GEMM's N (q/k/v: three; one slice: (N,)).
        a_row_offsets, a_step_rows: None, or the shrink's A tables (int64 [NS, S, R_max], as ``lora_shrink`` takes
            them) and ``build_step_rows`` of them (int64 [NS, S * R_block]): the GEMM then computes y itself (the
            shrink inside the launch: its first programs, one per (distinct slot, BLOCK_N of the slot's rank rows),
            write y, and the output tiles wait for them before their LoRA term); one launch per projection. The
            GEMM's rows must fit one row block (<= MAX_TILE_ROWS), and ``pdl`` does not apply.
        pdl: launch the GEMM with programmatic dependent launch (``kernels/pdl.py``): it may start while the kernel
            ahead of it in the stream (the shrink that writes y, which must then be launched right before it and
            with ``launch_dependents``) still runs, and waits for it only before the LoRA term. Ignored where PDL
            is unsupported.
    """

    y: torch.Tensor
    pool: torch.Tensor
    b_row_offsets: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_slots: torch.Tensor
    step_slots: torch.Tensor
    step_rows: torch.Tensor
    widths: tuple[int, ...]
    pdl: bool = True
    a_row_offsets: torch.Tensor | None = None
    a_step_rows: torch.Tensor | None = None


def r_block(max_rank: int) -> int:
    """The LoRA term's rank rows per slot in the GEMM: the tables' R_max rounded up to a power of two."""
    return triton.next_power_of_2(max(1, max_rank))


def lora_block_n(widths: tuple[int, ...], block_n: int) -> int:
    """The widest column block <= block_n (halving it, down to 16) with which no tile straddles two slices: every
    slice but the last a multiple of it; 0 where none is (the LoRA term then cannot be fused)."""
    while block_n >= 16:
        if all(w % block_n == 0 for w in widths[:-1]):
            return block_n
        block_n //= 2
    return 0


def _check_lora(lora: GemmLora, x: torch.Tensor, out_features: int) -> None:
    device = x.device
    num_rows = x.shape[0]
    check_tensor("lora.y", lora.y, dtype=torch.float32, dims=3, device=device)
    check_tensor("lora.pool", lora.pool, dtype=x.dtype, dims=1, device=device)
    check_tensor("lora.b_row_offsets", lora.b_row_offsets, dtype=torch.int64, dims=3, device=device)
    num_slices, num_slots, max_rank = lora.b_row_offsets.shape
    check_tensor("lora.ranks", lora.ranks, dtype=torch.int32, dims=2, device=device)
    check_tensor("lora.scalings", lora.scalings, dtype=torch.float32, dims=2, device=device)
    check_tensor("lora.token_slots", lora.token_slots, dtype=torch.int32, dims=1, device=device)
    check_tensor("lora.step_slots", lora.step_slots, dtype=torch.int32, dims=1, device=device)
    check_shape("lora.y", lora.y, (num_slices, num_rows, max_rank))
    check_shape("lora.ranks", lora.ranks, (num_slices, num_slots))
    check_shape("lora.scalings", lora.scalings, (num_slices, num_slots))
    check_shape("lora.token_slots", lora.token_slots, (num_rows,))
    check_shape("lora.step_slots", lora.step_slots, (2 + num_slots,))
    check_tensor("lora.step_rows", lora.step_rows, dtype=torch.int64, dims=2, device=device)
    check_shape("lora.step_rows", lora.step_rows, (num_slices, num_slots * r_block(max_rank)))
    if lora.step_rows.stride(1) != 1:
        raise ValueError(f"lora.step_rows needs a unit column stride, got {lora.step_rows.stride()}")
    if (lora.a_row_offsets is None) != (lora.a_step_rows is None):
        raise ValueError("lora.a_row_offsets and lora.a_step_rows come together (the shrink inside the launch)")
    if lora.a_step_rows is not None:
        check_tensor("lora.a_row_offsets", lora.a_row_offsets, dtype=torch.int64, dims=3, device=device)
        check_shape("lora.a_row_offsets", lora.a_row_offsets, (num_slices, num_slots, max_rank))
        check_tensor("lora.a_step_rows", lora.a_step_rows, dtype=torch.int64, dims=2, device=device)
        check_shape("lora.a_step_rows", lora.a_step_rows, (num_slices, num_slots * r_block(max_rank)))
        if lora.a_step_rows.stride(1) != 1:
            raise ValueError(f"lora.a_step_rows needs a unit column stride, got {lora.a_step_rows.stride()}")
        if num_rows > MAX_TILE_ROWS:
            raise ValueError(f"skinny_linear: the shrink inside the launch takes at most {MAX_TILE_ROWS} rows, got "
                             f"{num_rows}")
    if not 1 <= num_slices <= 3 or len(lora.widths) != num_slices or sum(lora.widths) != out_features:
        raise ValueError(f"lora.widths {lora.widths} must be 1-3 slices summing to the weight's {out_features} rows, "
                         f"one per slice of the tables ({num_slices})")
    if not lora.pool.is_contiguous():
        raise ValueError("lora.pool must be contiguous")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict[str, int] | None = None, lora: GemmLora | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for decode-sized x, in one Triton launch, with each row's LoRA term added.

    Semantics::

        out = x.float() @ weight.float().T + bias.float()             # accumulated in fp32
        if lora:                                                      # GemmLora's term, per row m of slot s >= 0
            for i, slice in enumerate(column slices of lora.widths):
                out[m, slice] += scalings[i, s] * y[i, m, :r].to(x.dtype) @ Bt[i, s][:r]   # r = ranks[i, s]
        out = out.to(x.dtype)                                         # one rounding

    Args:
        x: [M, K] fp16/bf16/fp32, unit column stride (any row stride). Meant for M <= MAX_SKINNY_ROWS (any M works,
            in tiles of up to MAX_TILE_ROWS rows; larger batches are cuBLAS's).
        weight: [N, K] of x's dtype, unit column stride (nn.Linear's layout).
        bias: [N] or None.
        config: ``gemm_config``'s keys, to override the heuristic (the benchmark's sweep).
        lora: the LoRA term to add (``GemmLora``); its slices must allow a column block of at least 16
            (``lora_block_n``), or a ValueError says so.

    Returns:
        out [M, N], contiguous, of x's dtype. fp32 inputs take an exact fp32 dot ("ieee"), 16-bit ones the tensor
        cores with fp32 accumulation (the precision only matters for fp32).
    """
    check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2)
    check_tensor("weight", weight, dtype=x.dtype, dims=2, device=x.device)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(f"weight is [{out_features}, {weight.shape[1]}]; x has {in_features} features")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight need unit column strides, got {x.stride()} and {weight.stride()}")
    if bias is not None:
        check_tensor("bias", bias, dims=1, device=x.device)
        if bias.shape[0] != out_features or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{out_features}], got {tuple(bias.shape)}")
    if lora is not None:
        _check_lora(lora, x, out_features)
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0 and lora is None:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    cfg = dict(config if config is not None else gemm_config(num_rows, out_features, in_features, x.element_size()))
    if lora is not None:
        block_n = lora_block_n(lora.widths, cfg["BLOCK_N"])
        if block_n == 0:
            raise ValueError(f"skinny_linear: LoRA slices of widths {lora.widths} leave no column block of 16 or more "
                             f"within one slice; add the LoRA term with lora_expand instead")
        cfg["BLOCK_N"] = block_n
    shrink = lora is not None and lora.a_step_rows is not None
    if shrink:
        cfg["BLOCK_M"] = max(16, triton.next_power_of_2(num_rows))  # one row block: the shrink programs cover it
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_k_blocks = max(1, cdiv(in_features, block_k))
    blocks_per_split = cdiv(num_k_blocks, max(1, min(int(cfg["SPLIT_K"]), num_k_blocks)))
    split = cdiv(num_k_blocks, blocks_per_split)
    grid = (cdiv(out_features, block_n), cdiv(num_rows, block_m), split)
    partial_rows = grid[1] * block_m
    if split > 1:
        partials, counters = _workspace(x.device, split, partial_rows, out_features, grid[0] * grid[1])
    else:
        partials = counters = out  # not read
    pdl = lora is not None and lora.pdl and not shrink and pdl_supported(x.device)
    blocks = _lora_blocks(lora)
    a_chunks = 1
    if shrink:
        num_slices, num_slots = lora.b_row_offsets.shape[:2]
        a_chunks = cdiv(num_slices * blocks["R_BLOCK"], block_n)
        num_a = num_slots * a_chunks
        shrink_args = (lora.a_step_rows, _sync(x.device), num_a, num_slices, lora.a_step_rows.stride(0))
        grid = (num_a + grid[0] * grid[1] * grid[2],)
    else:
        shrink_args = (out, out, 0, 0, 0)
    launch = relauncher(_skinny_gemm_kernel, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                        HAS_BIAS=bias is not None, EVEN_K=in_features % block_k == 0,
                        DOT_PRECISION="ieee", HAS_LORA=lora is not None, **blocks,
                        ROW_ALIGN=16 // x.element_size(), PDL=pdl, SHRINK=shrink, A_CHUNKS=a_chunks,
                        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 4),
                        **({"launch_pdl": True} if pdl else {}))  # fmt: skip
    launch(grid, x, weight, bias if bias is not None else out, out, partials, counters, num_rows, out_features,
           in_features, x.stride(0), weight.stride(0), out.stride(0), blocks_per_split * block_k, partial_rows,
           *_lora_args(lora, out), *shrink_args)
    return out


_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync(device: torch.device) -> torch.Tensor:
    """The zeroed int32 [3] tickets and counters of the launches that run their shrink inside (one at a time on a
    device's stream; the last program of each resets them), made once, outside any CUDA-graph capture."""
    if device not in _SYNC:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: no shrink counters yet; run a launch with the shrink inside once "
                               "outside CUDA-graph capture first")
        _SYNC[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return _SYNC[device]


def _lora_blocks(lora: GemmLora | None) -> dict[str, int]:
    """R_BLOCK, the tables' R_max rounded up to a power of two, and BLOCK_J, the (slot, rank row) pairs of a chunk
    of the LoRA term: 64 (four rank-16 slots), fewer for fewer slots of a smaller rank, at least tl.dot's 16 and
    one slot's R_BLOCK."""
    if lora is None:
        return {"R_BLOCK": 16, "BLOCK_J": 16}
    num_slots, max_rank = lora.b_row_offsets.shape[1:]
    block = r_block(max_rank)
    return {"R_BLOCK": block, "BLOCK_J": max(16, block, min(64, triton.next_power_of_2(num_slots * block)))}


def _lora_args(lora: GemmLora | None, out: torch.Tensor) -> tuple:
    """The kernel's LoRA arguments (pointers, slice bounds, strides); ``out`` in every place without one."""
    if lora is None:
        return (out,) * 6 + (0,) * 9
    bounds = list(itertools.accumulate(lora.widths))[:-1]
    bound_1, bound_2 = (bounds + [sum(lora.widths)] * 2)[:2]
    y, rows, sc = lora.y, lora.step_rows, lora.scalings
    return (y, lora.pool, rows, sc, lora.token_slots, lora.step_slots, bound_1, bound_2, y.shape[2],
            y.stride(0), y.stride(1), y.stride(2), rows.stride(0), sc.stride(0), sc.stride(1))

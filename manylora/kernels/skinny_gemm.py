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
0.5-0.67x). ``perf/kernels/bench_gemm.py`` times both per GEMM, ``perf/engine/bench_decode_step.py --base-gemm
torch,triton`` the whole step.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_config import NUM_SMS
from manylora.kernels.lora_meta import FLOAT_DTYPES, cdiv, check_tensor
from manylora.kernels.relaunch import relauncher

__all__ = ["MAX_SKINNY_ROWS", "gemm_config", "skinny_linear"]

# Rows above which the caller should keep cuBLAS
MAX_SKINNY_ROWS = 128
# Rows of one tile: more rows take several tiles, which read each weight block from HBM once and from L2 after (a
# single 128-row tile of 32 columns re-read the batch from L2 4x the weight's bytes and ran at 0.44-0.53x of cuBLAS
# on the H200, perf/results/2026-12-01-h200/18_gemm; the 64-row tiles came within 3-5% of it)
MAX_TILE_ROWS = 64


@triton.jit(do_not_specialize=["M"])  # the batch's rows change from step to step; serving compiles no new variants
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
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
        counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            return  # not the last split of this tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT_K):  # in split order, whichever arrived last
            acc += tl.load(partial_ptr + s * split_offs + tile_offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_offs = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


# Shared memory the pipeline's stages may take (the H100 / H200 allow 227 KB a program; the epilogue's layout
# conversion takes some of the rest). Compiled for sm_90, the 16-bit (wgmma) kernel keeps num_stages
# [BLOCK_M, BLOCK_K] + [BLOCK_K, BLOCK_N] buffers (perf/kernels/compile_report.py: 160 KB for 64 x 64 x 128 at
# 5 stages).
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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: dict[str, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for decode-sized x, in one Triton launch.

    Semantics::

        out = (x.float() @ weight.float().T + bias.float()).to(x.dtype)   # accumulated in fp32

    Args:
        x: [M, K] fp16/bf16/fp32, unit column stride (any row stride). Meant for M <= MAX_SKINNY_ROWS (any M works,
            in tiles of up to MAX_TILE_ROWS rows; larger batches are cuBLAS's).
        weight: [N, K] of x's dtype, unit column stride (nn.Linear's layout).
        bias: [N] or None.
        config: ``gemm_config``'s keys, to override the heuristic (the benchmark's sweep).

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
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0:
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    cfg = config if config is not None else gemm_config(num_rows, out_features, in_features, x.element_size())
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_k_blocks = cdiv(in_features, block_k)
    blocks_per_split = cdiv(num_k_blocks, max(1, min(int(cfg["SPLIT_K"]), num_k_blocks)))
    split = cdiv(num_k_blocks, blocks_per_split)
    grid = (cdiv(out_features, block_n), cdiv(num_rows, block_m), split)
    partial_rows = grid[1] * block_m
    if split > 1:
        partials, counters = _workspace(x.device, split, partial_rows, out_features, grid[0] * grid[1])
    else:
        partials = counters = out  # not read
    launch = relauncher(_skinny_gemm_kernel, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                        HAS_BIAS=bias is not None, EVEN_K=in_features % block_k == 0,
                        DOT_PRECISION="ieee",
                        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 4))  # fmt: skip
    launch(grid, x, weight, bias if bias is not None else out, out, partials, counters, num_rows, out_features,
           in_features, x.stride(0), weight.stride(0), out.stride(0), blocks_per_split * block_k, partial_rows)
    return out

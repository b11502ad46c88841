"""Fused MoE experts (Mixtral / Qwen3-MoE SwiGLU): a Triton grouped GEMM over expert-aligned blocks.

Weight layout (the same as vLLM's ``w13``/``w2`` and transformers 5's fused experts
``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]; a checkpoint stored [E, H, 2I] must be
transposed first)::

    w13 [E, 2I, H]: rows 0..I-1 = gate_proj.weight of expert e, rows I..2I-1 = up_proj.weight
    w2  [E, H, I]:  down_proj.weight of expert e

Semantics of ``fused_moe``::

    for t in range(T):
        for k in range(K):
            e = topk_ids[t, k]
            g, u = (w13[e] @ x[t]).split(I)
            out[t] += topk_weights[t, k] * (w2[e] @ (silu(g) * u))

Pipeline: ``moe_align_block_size`` sorts the T*K (token, k) pairs by expert into blocks of
BLOCK_M rows; the grouped GEMM ``C[pair] = A[row(pair)] @ W[expert(block)]^T`` runs once for w13
(A = x, row = pair // K) into a [T*K, 2I] cache, SiLU-and-mul gives h [T*K, I], and the GEMM runs
again for w2 (A = h, row = pair) with the routing weight multiplied in; the K rows of each token
are then summed. The launch grid is sized from shapes only and ``num_pairs`` is not specialised,
so a new token count neither synchronises nor recompiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from manylora.kernels.lora_meta import FLOAT_DTYPES, cdiv, check_shape, check_tensor
from manylora.kernels.moe_align import MoeAlignment, moe_align_block_size

__all__ = ["fused_moe", "fused_moe_gemm", "moe_gemm_config", "silu_and_mul", "check_moe_args", "moe_reduce"]


@triton.jit(do_not_specialize=["num_pairs"])
def _fused_moe_gemm_kernel(
    # pointers
    a_ptr,  # [rows, K_DIM]: x (row = pair // rows_div) or h (row = pair)
    w_ptr,  # [E, N, K_DIM]
    c_ptr,  # [num_pairs, N], written
    topk_weights_ptr,  # fp32 [num_pairs] (read with MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # int32 [max_blocks * BLOCK_M]
    block_expert_ids_ptr,  # int32 [max_blocks]
    num_post_padded_ptr,  # int32 [1]
    # sizes
    num_pairs,
    n_size,
    k_size,
    rows_div,
    # strides
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_post_padded = tl.load(num_post_padded_ptr)
    if pid_m * BLOCK_M >= num_post_padded:
        return  # past the last used block
    expert = tl.load(block_expert_ids_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)
    m_mask = pairs < num_pairs  # padding rows hold num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    rows = pairs // rows_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_size
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] = W[e]^T tile
        acc += tl.dot(a.to(w.dtype), w, input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0)
        acc = acc * rw.to(tl.float32)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def moe_gemm_config(num_pairs: int, num_experts: int, n_size: int, k_size: int) -> dict[str, int]:
    """Block sizes for the grouped GEMM (plain heuristic after vLLM's default config; tiles >= 16)."""
    per_expert = num_pairs / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    block_n = min(128 if block_m >= 64 else 64, max(16, triton.next_power_of_2(n_size)))
    block_k = min(64, max(16, triton.next_power_of_2(k_size)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}


def fused_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    align: MoeAlignment,
    *,
    rows_div: int,
    topk_weights: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Grouped GEMM over expert-aligned blocks, written into ``c``.

    Semantics::

        for p in range(align.num_pairs):
            e = expert of the block holding pair p
            c[p] = a[p // rows_div].float() @ w[e].float().T  (* topk_weights.flatten()[p])

    Rows of ``c`` whose pair appears in no block (none, for a base alignment) are untouched.

    Args:
        a: [rows, K_dim] (fp16/bf16/fp32), any strides.
        w: [E, N, K_dim], dtype of ``a``, any strides.
        c: [num_pairs, N], float dtype, any strides. Written.
        align: from ``moe_align_block_size`` with ``block_m`` = config BLOCK_M (no virtual ids).
        rows_div: pair p reads row ``p // rows_div`` of ``a`` (K for x, 1 for per-pair rows).
        topk_weights: optional fp32 [T, K]: multiply row p by ``topk_weights.flatten()[p]``.
        config: block sizes (``moe_gemm_config``); BLOCK_M must equal ``align.block_m``.
    """
    check_tensor("a", a, dtype=FLOAT_DTYPES, dims=2)
    device = a.device
    check_tensor("w", w, dtype=a.dtype, dims=3, device=device)
    check_tensor("c", c, dtype=FLOAT_DTYPES, dims=2, device=device)
    num_experts, n_size, k_size = w.shape
    if a.shape[1] != k_size:
        raise ValueError(f"a has {a.shape[1]} columns, w expects {k_size}")
    check_shape("c", c, (align.num_pairs, n_size))
    cfg = dict(config or moe_gemm_config(align.num_pairs, num_experts, n_size, k_size))
    if cfg["BLOCK_M"] != align.block_m:
        raise ValueError(f"config BLOCK_M {cfg['BLOCK_M']} != alignment block_m {align.block_m}")
    if align.num_experts != num_experts:
        raise ValueError(f"alignment was built for {align.num_experts} experts, w has {num_experts}")
    if align.num_pairs == 0 or n_size == 0:
        return c
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, dims=2, device=device)
        if topk_weights.numel() != align.num_pairs:
            raise ValueError(f"topk_weights must hold {align.num_pairs} weights, got {tuple(topk_weights.shape)}")
        rw = topk_weights.reshape(-1).contiguous()
    else:
        rw = c  # not read
    grid = (align.max_blocks, cdiv(n_size, cfg["BLOCK_N"]))
    _fused_moe_gemm_kernel[grid](
        a, w, c, rw,
        align.sorted_pair_ids, align.block_expert_ids, align.num_tokens_post_padded,
        align.num_pairs, n_size, k_size, rows_div,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION="ieee",
        **cfg,
    )  # fmt: skip
    return c


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[P, 2I] -> [P, I]: silu(gate_up[:, :I]) * gate_up[:, I:], computed in fp32."""
    inter = gate_up.shape[1] // 2
    g = gate_up[:, :inter].float()
    u = gate_up[:, inter:].float()
    return (F.silu(g) * u).to(gate_up.dtype)


def moe_reduce(c2: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T*K, H] routing-weighted expert outputs -> [T, H]: sum over k in fp32, cast once."""
    return c2.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(dtype)


def check_moe_args(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Validate the fused MoE arguments; returns (T, H, E, I, K)."""
    check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2)
    device = x.device
    num_tokens, hidden = x.shape
    check_tensor("w13", w13, dtype=x.dtype, dims=3, device=device)
    check_tensor("w2", w2, dtype=x.dtype, dims=3, device=device)
    num_experts, two_inter, w13_hidden = w13.shape
    if two_inter % 2 or w13_hidden != hidden:
        raise ValueError(f"w13 must have shape (E, 2I, {hidden}), got {tuple(w13.shape)}")
    inter = two_inter // 2
    check_shape("w2", w2, (num_experts, hidden, inter))
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), dims=2, device=device)
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must have {num_tokens} rows, got shape {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, dims=2, device=device)
    check_shape("topk_weights", topk_weights, (num_tokens, top_k))
    return num_tokens, hidden, num_experts, inter, top_k


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """SwiGLU MoE experts over expert-aligned blocks (no LoRA). See the module docstring.

    Args:
        x: [T, H] fp16/bf16/fp32.
        w13: [E, 2I, H], dtype of x: gate rows then up rows per expert.
        w2: [E, H, I], dtype of x.
        topk_ids: int32/int64 [T, K], each in [0, E) (not checked on the device).
        topk_weights: fp32 [T, K], already normalised by the model's rule.
        config: optional block sizes for both GEMMs (keys of ``moe_gemm_config``).

    Returns:
        out [T, H], dtype of x. Accumulation in fp32; the w13 cache and h are held in x's dtype.
    """
    num_tokens, hidden, num_experts, inter, top_k = check_moe_args(x, w13, w2, topk_ids, topk_weights)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    cfg13 = dict(config or moe_gemm_config(num_pairs, num_experts, 2 * inter, hidden))
    cfg2 = dict(config or moe_gemm_config(num_pairs, num_experts, hidden, inter))
    align = moe_align_block_size(topk_ids, num_experts, cfg13["BLOCK_M"])
    c13 = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    fused_moe_gemm(x, w13, c13, align, rows_div=top_k, config=cfg13)
    h = silu_and_mul(c13)
    c2 = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    fused_moe_gemm(h, w2, c2, align, rows_div=1, topk_weights=topk_weights, config=cfg2)
    return moe_reduce(c2, num_tokens, top_k, x.dtype)

"""Rotary embedding and the paged KV-cache write of an attention layer in one kernel.

After the fused q/k/v projection the model rotates q and k (rotate-half RoPE, optionally after Qwen3's per-head
RMSNorm) and stores k and v at each token's KV slot. As torch ops that is about eight launches a layer (norm, neg,
cat, two muls, add, two indexed copies), 21 us a layer in the H200's batch-64 decode step
(perf/results/2026-12-01-h200/11_step_kernels); here it is one launch that reads q/k/v once, rotates q in place
and writes the rotated k and v straight into their pages.

Numerics follow those torch ops exactly: the optional norm as ``manylora.engine.models.llama.rms_norm`` (float32,
rounded,
then times the weight and rounded again), then ``x * cos`` and ``rotate_half(x) * sin`` each rounded to the
activation dtype, and their sum rounded once more. The kernel is compiled without floating-point fusion: with it,
the compiler turns "bf16 product, rounded, plus bf16 product" into one bf16 FMA that skips the first rounding (one
bf16 step off the torch ops in ~24% of random elements as emulated on the CPU; the compiled test on the H200 caught
it, perf/results/2026-12-01-h200/15_pdl).

``lora_delta`` (fp32, [T, (NQ + 2 NKV) * D]) is the q/k/v projection's LoRA term computed beside its base GEMM
(the engine's ``LoraDelta``): added to q, k and v first, in fp32 and rounded once, as the LoRA expand adds into
the projection's output in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_meta import FLOAT_DTYPES, check_shape, check_tensor
from manylora.kernels.relaunch import relauncher

__all__ = ["rope_kv_write"]


@triton.jit(do_not_specialize=["layer", "eps"])  # the layer changes from call to call: no variants per layer
def _rope_kv_write_kernel(
    qk_ptr,  # [T, NQ + NKV, D]: q heads then k heads; q is rotated in place
    v_ptr,  # [T, NKV, D]
    positions_ptr,  # int64 [T]
    cos_ptr,  # [max_len, D]
    sin_ptr,  # [max_len, D]
    slots_ptr,  # int64 [T]: page * page_size + offset of each token's k, v
    kv_ptr,  # [pages, layers, 2, page_size, NKV, D]
    norm_ptr,  # [NQ + NKV, D]: the per-head RMSNorm weight of each q and k head (read only with NORM)
    lora_ptr,  # fp32 [T, (NQ + 2 NKV) * D]: the q/k/v projection's LoRA term (read only with HAS_LORA)
    layer,
    page_size,
    eps,
    stride_qkt,
    stride_qkh,
    stride_vt,
    stride_vh,
    stride_lt,
    stride_cos,
    stride_kvp,
    stride_kvl,
    stride_kvk,
    stride_kvo,
    stride_kvh,
    NQ: tl.constexpr,
    NKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= NQ + NKV, a power of two
    BLOCK_V: tl.constexpr,  # >= NKV, a power of two
    BLOCK_D: tl.constexpr,  # >= D, a power of two (each half's columns: BLOCK_D // 2)
    NORM: tl.constexpr,
    HAS_LORA: tl.constexpr,
):
    """Program (t, 0): token t's q and k heads, a [BLOCK_H, BLOCK_D] tile; program (t, 1): its v heads."""
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    slot = tl.load(slots_ptr + token)
    page, offset = slot // page_size, slot % page_size
    kv_row = kv_ptr + page * stride_kvp + layer * stride_kvl + offset * stride_kvo
    if tl.program_id(1) == 1:  # the v heads: copied into the page
        offs_v = tl.arange(0, BLOCK_V)
        mask = (offs_v < NKV)[:, None] & d_mask[None, :]
        v = tl.load(v_ptr + token * stride_vt + offs_v[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
        if HAS_LORA:  # v's columns follow the q and k heads'
            lora_v = lora_ptr + token * stride_lt + (NQ + NKV + offs_v[:, None]) * D + offs_d[None, :]
            v = (v.to(tl.float32) + tl.load(lora_v, mask=mask, other=0.0)).to(v.dtype)
        tl.store(kv_row + stride_kvk + offs_v[:, None] * stride_kvh + offs_d[None, :], v, mask=mask)
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_D // 2)  # a column of each half: (c, c + D // 2) rotate together
    c_mask = offs_c < D // 2
    mask = (offs_h < NQ + NKV)[:, None] & c_mask[None, :]
    rows = qk_ptr + token * stride_qkt + offs_h[:, None] * stride_qkh + offs_c[None, :]
    x1 = tl.load(rows, mask=mask, other=0.0)
    x2 = tl.load(rows + D // 2, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_LORA:  # the projection's output with its LoRA term, rounded as the in-place expand leaves it
        lora_rows = lora_ptr + token * stride_lt + offs_h[:, None] * D + offs_c[None, :]
        x1 = (x1.to(tl.float32) + tl.load(lora_rows, mask=mask, other=0.0)).to(dtype)
        x2 = (x2.to(tl.float32) + tl.load(lora_rows + D // 2, mask=mask, other=0.0)).to(dtype)
    if NORM:  # rms_norm(x) * w per head, rounded as the torch ops are
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)[:, None]
        w_rows = norm_ptr + offs_h[:, None] * D + offs_c[None, :]
        w1 = tl.load(w_rows, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_rows + D // 2, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
    pos = tl.load(positions_ptr + token)
    c1 = tl.load(cos_ptr + pos * stride_cos + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_cos + D // 2 + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_cos + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_cos + D // 2 + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # rotate_half(x) = (-x2, x1): each product rounded, then the sum
    y1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    is_q = (offs_h < NQ)[:, None]
    tl.store(rows, y1, mask=mask & is_q)
    tl.store(rows + D // 2, y2, mask=mask & is_q)
    k_rows = kv_row + (offs_h - NQ)[:, None] * stride_kvh + offs_c[None, :]
    tl.store(k_rows, y1, mask=mask & ~is_q)
    tl.store(k_rows + D // 2, y2, mask=mask & ~is_q)


def rope_kv_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    num_q_heads: int,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    lora_delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q in place, and store rotated k and v in the paged KV cache; returns the q heads (a view of ``qk``).

    Semantics (NQ = num_q_heads, ps = kv.shape[3], ``rms_norm`` that of manylora.engine.models.llama)::

        if lora_delta is not None:                             # columns: q heads, k heads, v heads
            qk = (qk.float() + lora_delta[:, :(NQ + NKV) * D].view(T, NQ + NKV, D)).to(dtype)
            v = (v.float() + lora_delta[:, (NQ + NKV) * D:].view(T, NKV, D)).to(dtype)
        if norm is not None:
            qk = rms_norm(qk, norm, eps)                       # per head, over D
        half = D // 2
        rot = cat(-qk[..., half:], qk[..., :half])
        c, s = cos[positions][:, None], sin[positions][:, None]
        r = (qk * c) + (rot * s)                               # each product rounded, then the sum
        qk[:, :NQ] = r[:, :NQ]
        page, off = slots // ps, slots % ps
        kv[page, layer, 0, off] = r[:, NQ:]
        kv[page, layer, 1, off] = v

    Args:
        qk: [T, NQ + NKV, D] fp16/bf16/fp32: the q heads then the k heads (a view of the q/k/v projection's
            output); unit stride along D. Its q heads are overwritten.
        v: [T, NKV, D], qk's dtype, unit stride along D.
        positions: int64 [T]: each token's position (row of cos / sin), below max_len (not checked: the scheduler
            keeps positions under the model's length).
        cos, sin: [max_len, D], qk's dtype, unit stride along D.
        kv: [pages, layers, 2, page_size, NKV, D], qk's dtype, contiguous (the unified pool's KV view).
        layer: the layer whose keys and values are written.
        slots: int64 [T]: page * page_size + offset where each token's k, v go.
        num_q_heads: NQ.
        norm: optional [NQ + NKV, D] per-head RMSNorm weights (Qwen3's q_norm for each q head, then k_norm).
        eps: the norm's epsilon.
        lora_delta: optional float32 [T, (NQ + 2 NKV) * D], contiguous rows: the q/k/v projection's LoRA term.

    Returns:
        ``qk[:, :NQ]``: the rotated q heads.
    """
    check_tensor("qk", qk, dtype=FLOAT_DTYPES, dims=3)
    num_tokens, heads, head_dim = qk.shape
    num_kv_heads = heads - num_q_heads
    if num_q_heads <= 0 or num_kv_heads <= 0:
        raise ValueError(f"qk has {heads} heads: need num_q_heads ({num_q_heads}) q heads and at least one k head")
    device = qk.device
    check_tensor("v", v, dtype=qk.dtype, dims=3, device=device)
    check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    check_tensor("positions", positions, dtype=torch.int64, dims=1, device=device)
    check_shape("positions", positions, (num_tokens,))
    check_tensor("slots", slots, dtype=torch.int64, dims=1, device=device)
    check_shape("slots", slots, (num_tokens,))
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table, dtype=qk.dtype, dims=2, device=device)
        if table.shape[1] != head_dim or table.stride(1) != 1:
            raise ValueError(f"{name} must be [max_len, {head_dim}] with unit column stride, got "
                             f"{tuple(table.shape)} strides {table.stride()}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin must share a row stride, got {cos.stride(0)} and {sin.stride(0)}")
    check_tensor("kv", kv, dtype=qk.dtype, dims=6, device=device)
    if not kv.is_contiguous() or kv.shape[2] != 2 or tuple(kv.shape[4:]) != (num_kv_heads, head_dim):
        raise ValueError(f"kv must be a contiguous [pages, layers, 2, page_size, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(kv.shape)}")
    if not 0 <= layer < kv.shape[1]:
        raise ValueError(f"layer {layer} outside the KV cache's {kv.shape[1]} layers")
    if head_dim % 2:
        raise ValueError(f"rotate-half RoPE needs an even head_dim, got {head_dim}")
    if qk.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"qk and v need unit stride along head_dim, got {qk.stride()} and {v.stride()}")
    if norm is not None:
        check_tensor("norm", norm, dtype=FLOAT_DTYPES, dims=2, device=device)
        check_shape("norm", norm, (heads, head_dim))
        norm = norm.contiguous()
    if lora_delta is not None:
        check_tensor("lora_delta", lora_delta, dtype=torch.float32, dims=2, device=device)
        check_shape("lora_delta", lora_delta, (num_tokens, (heads + num_kv_heads) * head_dim))
        if lora_delta.stride(1) != 1:
            raise ValueError(f"lora_delta must have unit column stride, got strides {lora_delta.stride()}")
    q = qk[:, :num_q_heads]
    if num_tokens == 0:
        return q
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    relaunch = relauncher(_rope_kv_write_kernel, NQ=num_q_heads, NKV=num_kv_heads, D=head_dim, BLOCK_H=block_h,
                          BLOCK_V=triton.next_power_of_2(num_kv_heads), BLOCK_D=block_d, NORM=norm is not None,
                          HAS_LORA=lora_delta is not None, num_warps=4 if block_h * block_d >= 2048 else 1,
                          enable_fp_fusion=False)
    relaunch(
        (num_tokens, 2), qk, v, positions, cos, sin, slots, kv,
        norm if norm is not None else qk, lora_delta if lora_delta is not None else qk, layer, kv.shape[3], eps,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
        lora_delta.stride(0) if lora_delta is not None else 0, cos.stride(0),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), kv.stride(4),
    )  # fmt: skip
    return q

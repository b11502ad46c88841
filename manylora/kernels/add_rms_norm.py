"""Residual add and RMSNorm in one kernel (the Llama block's ``h = h + delta; x = norm(h)``).

Numerics follow the unfused torch ops of the model (Hugging Face's LlamaRMSNorm): the sum is
rounded to the activation dtype (as ``h + delta`` is), the norm is computed in float32 from that
rounded sum, cast back, then multiplied by the weight in the activation dtype.

``lora_delta`` (fp32, [T, N]) is a row-parallel projection's LoRA term computed beside its base GEMM
(``manylora/engine/lora_batch.LoraDelta``): it is added to ``delta`` first, in fp32 and rounded once, as the LoRA expand
adds into the projection's output in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from manylora.kernels.lora_meta import FLOAT_DTYPES, check_shape, check_tensor
from manylora.kernels.relaunch import relauncher

__all__ = ["add_rms_norm"]


@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(
    x_ptr,  # [T, N]: the residual stream before the add
    delta_ptr,  # [T, N]: what is added (read only with HAS_DELTA)
    lora_ptr,  # fp32 [T, N]: the LoRA term of delta (read only with HAS_LORA)
    weight_ptr,  # [N]
    sum_ptr,  # [T, N]: x + delta (written only with HAS_DELTA)
    out_ptr,  # [T, N]: rms_norm(x + delta) * weight
    n_cols,
    stride_x,
    stride_d,
    stride_l,
    stride_s,
    stride_o,
    eps,
    HAS_DELTA: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        if HAS_LORA:  # the projection's output with its LoRA term, rounded as the in-place expand leaves it
            lora = tl.load(lora_ptr + row * stride_l + offs, mask=mask, other=0.0)
            delta = (delta.to(tl.float32) + lora).to(delta.dtype)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)  # rounded as the torch add is
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
    lora_delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta) * weight, x + delta); without ``delta``, (rms_norm(x) * weight, x).

    Semantics::

        if lora_delta is not None:
            delta = (delta.float() + lora_delta).to(x.dtype)
        s = (x + delta) if delta is not None else x          # in x.dtype
        out = weight * (s.float() * rsqrt(mean(s.float() ** 2, -1) + eps)).to(x.dtype)

    Args:
        x: [T, N] fp16/bf16/fp32, rows with unit column stride (any row stride).
        delta: [T, N] of x's dtype, or None.
        weight: [N] of x's dtype.
        eps: the norm's epsilon.
        lora_delta: optional float32 [T, N] (needs ``delta``): delta's LoRA term, unit column stride.

    Returns:
        (out [T, N] contiguous, s [T, N] contiguous (a new tensor when delta is given, else x)).
    """
    check_tensor("x", x, dtype=FLOAT_DTYPES, dims=2)
    num_rows, n_cols = x.shape
    check_tensor("weight", weight, dtype=x.dtype, dims=1, device=x.device)
    check_shape("weight", weight, (n_cols,))
    if delta is not None:
        check_tensor("delta", delta, dtype=x.dtype, dims=2, device=x.device)
        check_shape("delta", delta, (num_rows, n_cols))
    if lora_delta is not None:
        if delta is None:
            raise ValueError("add_rms_norm's lora_delta is the LoRA term of delta: pass delta with it")
        check_tensor("lora_delta", lora_delta, dtype=torch.float32, dims=2, device=x.device)
        check_shape("lora_delta", lora_delta, (num_rows, n_cols))
    for name, t in (("x", x), ("delta", delta), ("lora_delta", lora_delta), ("weight", weight)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension, got strides {t.stride()}")
    out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if delta is not None else x
    if num_rows == 0:
        return out, total
    block = triton.next_power_of_2(n_cols)
    launch = relauncher(_add_rms_norm_kernel, HAS_DELTA=delta is not None, HAS_LORA=lora_delta is not None,
                        BLOCK=block, num_warps=8 if block >= 4096 else 4)
    d = delta if delta is not None else x
    lora = lora_delta if lora_delta is not None else x
    launch(
        (num_rows,), x, d, lora, weight, total, out,
        n_cols, x.stride(0), d.stride(0), lora.stride(0), total.stride(0), out.stride(0), float(eps),
    )  # fmt: skip
    return out, total

"""Fused MoE-LoRA: per-(adapter, expert) LoRA on the expert projections, folded into the fused MoE path.

Each token t may carry an adapter slot s = token_slots[t] (-1 = none). An adapter holds, for
every expert e, LoRA matrices for the fused gate/up projection (A13, B13) and for the down
projection (A2, B2). For a pair (t, k) routed to expert e::

    gu   = w13[e] @ x[t] + scaling_s * B13_{s,e} @ (A13_{s,e} @ x[t])       # before the activation
    h    = silu(gu[:I]) * gu[I:]
    y    = w2[e] @ h + scaling_s * B2_{s,e} @ (A2_{s,e} @ h)                  # before the weighted sum
    out[t] += topk_weights[t, k] * y

w13 may carry its LoRA as one slice (A13 [r, H], B13 [2I, r]) or as two slices, gate and up,
each with its own A [r, H] and B [I, r] (PEFT adapters that target gate_proj and up_proj
separately): slice i adds into columns [i * 2I / NS, (i + 1) * 2I / NS) of the w13 output.

Paged adapter rows (as in ``manylora.kernels.lora_shrink``/``lora_expand``): row k of A_{s,e} (length =
the projection's input width) starts at pool element ``a_offsets[slice, s, e, k]``; B is stored
transposed, row k of B^T (= B[:, k], length = the slice's output width) at
``b_offsets[slice, s, e, k]``. One rank per adapter (``ranks[s]``), one scaling (``scalings[s]``).

This module holds the layer's forward: the base grouped GEMMs of ``manylora.kernels.fused_moe`` with the
LoRA shrink/expand of one of two kernel forms between them, ``manylora.kernels.moe_lora_blocks`` (tl.dot
tiles over a second alignment by virtual expert slot * E + e; prefill-sized batches) or
``manylora.kernels.moe_lora_pairs`` (one program per (token, k) pair; decode-sized batches).

No Python loop over experts or adapters; lengths are not specialised (``do_not_specialize``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from manylora.kernels.fused_moe import (
    check_moe_args,
    fused_moe,
    fused_moe_gemm,
    moe_gemm_config,
    moe_reduce,
    silu_and_mul,
)
from manylora.kernels.lora_meta import check_shape, check_tensor, sliced_offsets
from manylora.kernels.moe_align import MoeAlignment, moe_align_block_size
from manylora.kernels.moe_lora_blocks import moe_lora_expand, moe_lora_shrink
from manylora.kernels.moe_lora_pairs import moe_lora_expand_pairs, moe_lora_shrink_pairs

__all__ = ["MoeLora", "fused_moe_lora_forward"]


@dataclass(frozen=True)
class MoeLora:
    """The adapters of one MoE layer and the batch's adapter mapping.

    Attributes:
        pool: [P], 1-D contiguous, dtype of x: flat pool holding all rank rows.
        a13_offsets: int64 [S, E, R_max] (one slice) or [NS, S, E, R_max] (NS = 2: gate, up):
            pool offset of row k of A13 (length H); entries k >= ranks[s] are not read.
        b13_offsets: int64, same shape as ``a13_offsets``: row k of B13^T (length 2I / NS).
        a2_offsets: int64 [S, E, R_max]: row k of A2 (length I).
        b2_offsets: int64 [S, E, R_max]: row k of B2^T (length H).
        ranks: int32 [S], each in 1..R_max.
        scalings: float32 [S] (alpha / r).
        token_slots: int32 [T]: slot of each token, -1 = no adapter.
    """

    pool: torch.Tensor
    a13_offsets: torch.Tensor
    b13_offsets: torch.Tensor
    a2_offsets: torch.Tensor
    b2_offsets: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    token_slots: torch.Tensor

def _check_lora(lora: MoeLora, num_tokens: int, num_experts: int, inter: int, x: torch.Tensor) -> int:
    """Validate ``lora`` against the layer; returns the number of w13 slices."""
    if not isinstance(lora, MoeLora):
        raise TypeError(f"lora must be a MoeLora, got {type(lora).__name__}")
    device = x.device
    check_tensor("lora.pool", lora.pool, dtype=x.dtype, dims=1, device=device)
    a13 = sliced_offsets("lora.a13_offsets", lora.a13_offsets, device)
    num_slices, num_slots, lora_experts, max_rank = a13.shape
    if lora_experts != num_experts:
        raise ValueError(f"lora tables cover {lora_experts} experts, the layer has {num_experts}")
    if (2 * inter) % num_slices:
        raise ValueError(f"{num_slices} w13 LoRA slices do not divide 2I = {2 * inter}")
    check_shape("lora.b13_offsets", sliced_offsets("lora.b13_offsets", lora.b13_offsets, device), tuple(a13.shape))
    for name in ("a2_offsets", "b2_offsets"):
        t = getattr(lora, name)
        check_tensor(f"lora.{name}", t, dtype=torch.int64, dims=3, device=device)
        check_shape(f"lora.{name}", t, (num_slots, num_experts, max_rank))
    check_tensor("lora.ranks", lora.ranks, dtype=torch.int32, dims=1, device=device)
    check_shape("lora.ranks", lora.ranks, (num_slots,))
    check_tensor("lora.scalings", lora.scalings, dtype=torch.float32, dims=1, device=device)
    check_shape("lora.scalings", lora.scalings, (num_slots,))
    check_tensor("lora.token_slots", lora.token_slots, dtype=torch.int32, dims=1, device=device)
    check_shape("lora.token_slots", lora.token_slots, (num_tokens,))
    return num_slices


def fused_moe_lora_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    lora: MoeLora | None = None,
    *,
    config: dict[str, int] | None = None,
    lora_form: str | None = None,
) -> torch.Tensor:
    """SwiGLU MoE experts with per-(adapter, expert) LoRA on w13 and w2 (see the module docstring).

    Semantics::

        for t, k:  e = topk_ids[t, k];  s = lora.token_slots[t]
            gu = w13[e] @ x[t] + (s >= 0) * scalings[s] * concat_i(B13_{i,s,e} @ (A13_{i,s,e} @ x[t]))
            h = silu(gu[:I]) * gu[I:]
            y = w2[e] @ h + (s >= 0) * scalings[s] * B2_{s,e} @ (A2_{s,e} @ h)
            out[t] += topk_weights[t, k] * y

    Launches: the alignment by expert, then w13 GEMM -> LoRA shrink -> LoRA expand into the w13
    output -> SiLU-and-mul -> w2 GEMM (routing weight applied) -> LoRA shrink -> LoRA expand
    (routing weight applied) -> sum over k. The LoRA kernels take one of two forms (``lora_form``):
    "blocks", over a second alignment by virtual expert slot * E + e (slot -1 dropped), a tl.dot
    tile per (adapter, expert) block, split-K; or "pairs" (``manylora.kernels.moe_lora_pairs``), one
    program per (token, k) pair and no second alignment, for decode-sized batches. None picks
    "pairs" up to ``PAIR_FORM_MAX_PAIRS`` pairs (env MANYLORA_MOE_LORA_FORM=pairs|blocks forces
    one). With ``lora=None`` this is exactly ``fused_moe``; when no token has an adapter the LoRA
    kernels touch nothing and the result is bit-identical to ``fused_moe`` as well.

    Args:
        x, w13, w2, topk_ids, topk_weights: as ``manylora.kernels.fused_moe.fused_moe``.
        lora: MoeLora (pool, offset tables, ranks, scalings, token_slots) or None.
        config: optional block sizes for the base GEMMs (keys of ``moe_gemm_config``); the LoRA
            kernels of the block form use the same BLOCK_M.
        lora_form: "pairs", "blocks" or None (see above).

    Returns:
        out [T, H], dtype of x.
    """
    if lora is None:
        return fused_moe(x, w13, w2, topk_ids, topk_weights, config=config)
    num_tokens, hidden, num_experts, inter, top_k = check_moe_args(x, w13, w2, topk_ids, topk_weights)
    num_slices = _check_lora(lora, num_tokens, num_experts, inter, x)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    num_slots, max_rank = lora.a2_offsets.shape[0], lora.a2_offsets.shape[2]
    cfg13 = dict(config or moe_gemm_config(num_pairs, num_experts, 2 * inter, hidden))
    cfg2 = dict(config or moe_gemm_config(num_pairs, num_experts, hidden, inter))
    block_m = cfg13["BLOCK_M"]
    align = moe_align_block_size(topk_ids, num_experts, block_m)
    form = lora_form or _default_form(num_pairs)
    if form not in ("pairs", "blocks"):
        raise ValueError(f"lora_form must be 'pairs' or 'blocks', got {form!r}")
    if form == "pairs":
        shrink, expand = _pair_lora(topk_ids, lora.token_slots)
    else:
        lora_align = moe_align_block_size(topk_ids, num_experts, block_m, token_slots=lora.token_slots,
                                          num_slots=num_slots)  # fmt: skip
        shrink, expand = _block_lora(lora_align)

    c13 = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    fused_moe_gemm(x, w13, c13, align, rows_div=top_k, config=cfg13)
    y13 = _shrink_out(form, num_slices, num_pairs, max_rank, x.device)
    shrink(x, lora.pool, lora.a13_offsets, lora.ranks, y13, rows_div=top_k)
    expand(y13, lora.pool, lora.b13_offsets, lora.ranks, lora.scalings, c13)

    h = silu_and_mul(c13)
    c2 = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    fused_moe_gemm(h, w2, c2, align, rows_div=1, topk_weights=topk_weights, config=cfg2)
    y2 = _shrink_out(form, 1, num_pairs, max_rank, x.device)
    shrink(h, lora.pool, lora.a2_offsets, lora.ranks, y2, rows_div=1)
    expand(y2, lora.pool, lora.b2_offsets, lora.ranks, lora.scalings, c2, topk_weights=topk_weights)
    return moe_reduce(c2, num_tokens, top_k, x.dtype)


# (token, k) pairs up to which the LoRA kernels run one program per pair: batch 256 at top-8, where the pair form
# still beat the block form on the H200 (a Qwen3-30B-A3B decode step, 8 adapters: 44.9 vs 48.0 ms)
PAIR_FORM_MAX_PAIRS = 2048


def _default_form(num_pairs: int) -> str:
    forced = os.environ.get("MANYLORA_MOE_LORA_FORM", "")
    if forced in ("pairs", "blocks"):
        return forced
    return "pairs" if num_pairs <= PAIR_FORM_MAX_PAIRS else "blocks"


def _shrink_out(form: str, num_slices: int, num_pairs: int, max_rank: int, device: torch.device) -> torch.Tensor:
    """The shrink's fp32 output: the block form adds into zeros; the pair form writes what the expand reads (and
    zeroes it itself when it splits K)."""
    alloc = torch.empty if form == "pairs" else torch.zeros
    return alloc(num_slices, num_pairs, max_rank, dtype=torch.float32, device=device)


def _pair_lora(topk_ids: torch.Tensor, token_slots: torch.Tensor):
    """(shrink, expand) of the pair form, bound to the routing."""

    def shrink(a_in, pool, a_offsets, ranks, y, *, rows_div):
        moe_lora_shrink_pairs(a_in, pool, a_offsets, ranks, topk_ids, token_slots, y, rows_div=rows_div)

    def expand(y, pool, b_offsets, ranks, scalings, out, topk_weights=None):
        moe_lora_expand_pairs(y, pool, b_offsets, ranks, scalings, topk_ids, token_slots, out,
                              topk_weights=topk_weights)  # fmt: skip

    return shrink, expand


def _block_lora(lora_align: MoeAlignment):
    """(shrink, expand) of the block form, bound to the virtual-expert alignment."""

    def shrink(a_in, pool, a_offsets, ranks, y, *, rows_div):
        moe_lora_shrink(a_in, pool, a_offsets, ranks, lora_align, y, rows_div=rows_div)

    def expand(y, pool, b_offsets, ranks, scalings, out, topk_weights=None):
        moe_lora_expand(y, pool, b_offsets, ranks, scalings, lora_align, out, topk_weights=topk_weights)

    return shrink, expand

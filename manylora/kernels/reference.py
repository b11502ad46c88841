"""Plain torch references of the kernels: same signatures and in-place semantics.

Written for clarity, not speed (Python loops over slots and sequences). The tests compare the
Triton kernels against them, and the engine can use them as its CPU fallback. All arithmetic
is fp32; results are cast once to the output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from manylora.kernels.lora_meta import SegmentMeta

__all__ = ["ref_lora_shrink", "ref_lora_expand", "ref_paged_decode_attention", "ref_add_rms_norm", "ref_silu_mul"]


def _gather_rows(pool: torch.Tensor, offsets: torch.Tensor, length: int) -> torch.Tensor:
    """fp32 [len(offsets), length]: the pool rows starting at ``offsets``."""
    rows = []
    for off in offsets.tolist():
        if off < 0 or off + length > pool.numel():
            raise IndexError(f"row [{off}, {off + length}) lies outside the pool of {pool.numel()} elements")
        rows.append(pool[off : off + length])
    if not rows:
        return torch.zeros(0, length, dtype=torch.float32, device=pool.device)
    return torch.stack(rows).float()


def _as3(t: torch.Tensor, single: bool) -> torch.Tensor:
    return t.unsqueeze(0) if single else t


def ref_lora_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_row_offsets: torch.Tensor,
    ranks: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    segments: SegmentMeta | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Reference of ``manylora.kernels.lora_shrink.lora_shrink`` (``segments``/``config`` are ignored).

    out[i, t, :r] = A_{i, slot(t)} @ x[t] (fp32), out[i, t, r:] = 0; rows with slot -1 are zero
    (``out`` is overwritten whole, as the kernel's split-K form zeroes it before adding).
    """
    del segments, config
    single = a_row_offsets.dim() == 2
    a3, ranks3, out3 = _as3(a_row_offsets, single), _as3(ranks, single), _as3(out, single)
    out3.zero_()
    in_features = x.shape[1]
    xf = x.float()
    for i in range(a3.shape[0]):
        for s in sorted(set(token_slots.tolist()) - {-1}):
            tokens = torch.nonzero(token_slots == s).flatten()
            r = int(ranks3[i, s])
            a = _gather_rows(pool, a3[i, s, :r], in_features)  # [r, in]
            rows = torch.zeros(tokens.numel(), out3.shape[2], dtype=torch.float32, device=out.device)
            rows[:, :r] = xf[tokens] @ a.T
            out3[i, tokens] = rows
    return out


def ref_lora_expand(
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
) -> torch.Tensor:
    """Reference of ``manylora.kernels.lora_expand.lora_expand`` (``segments``/``config`` are ignored).

    base_out[t, lo_i:hi_i] += scalings[i, s] * y[i, t, :r] @ Bt_{i, s}[:r]   for s = slot(t) >= 0.
    """
    del segments, config
    single = y.dim() == 2
    y3, b3 = _as3(y, single), _as3(b_row_offsets, single)
    ranks3, scalings3 = _as3(ranks, single), _as3(scalings, single)
    num_slices = y3.shape[0]
    if slice_offsets is None:
        slice_offsets = [0, base_out.shape[1]]
    bounds = [int(v) for v in (slice_offsets.tolist() if isinstance(slice_offsets, torch.Tensor) else slice_offsets)]
    if len(bounds) == num_slices:
        bounds.append(base_out.shape[1])
    for i in range(num_slices):
        lo, hi = bounds[i], bounds[i + 1]
        for s in sorted(set(token_slots.tolist()) - {-1}):
            tokens = torch.nonzero(token_slots == s).flatten()
            r = int(ranks3[i, s])
            bt = _gather_rows(pool, b3[i, s, :r], hi - lo)  # [r, hi - lo]
            delta = float(scalings3[i, s]) * (y3[i, tokens, :r].float() @ bt)
            base_out[tokens, lo:hi] = (base_out[tokens, lo:hi].float() + delta).to(base_out.dtype)
    return base_out


def ref_paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    layer: int,
    num_layers: int,
    page_size: int,
    num_kv_heads: int,
    table_rows: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Reference of ``manylora.kernels.paged_attention.paged_decode_attention`` (``config`` ignored)."""
    del config
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    page_elems = num_layers * 2 * page_size * num_kv_heads * head_dim
    num_pages = pool.numel() // page_elems
    kv = pool[: num_pages * page_elems].view(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            out[b] = 0
            continue
        t = b if table_rows is None else int(table_rows[b])
        pages = block_tables[t, : (n + page_size - 1) // page_size].long()
        k = kv[pages, layer, 0].reshape(-1, num_kv_heads, head_dim)[:n].float()  # [n, n_kv, d]
        v = kv[pages, layer, 1].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, n_heads, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        w = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Fused MoE (SwiGLU experts) and MoE-LoRA references.
# ----------------------------------------------------------------------------------------------

__all__ += ["ref_fused_moe", "ref_fused_moe_lora"]


def _ref_moe_core(x, w13, w2, topk_ids, topk_weights, lora_delta13=None, lora_delta2=None) -> torch.Tensor:
    """Per-expert loop; ``lora_delta*(tokens, e, inp)`` return the fp32 LoRA delta of those pairs."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(w13.shape[0]):
        tokens, ks = torch.nonzero(topk_ids.long() == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gu = xf[tokens] @ w13[e].float().T  # [n, 2I]
        if lora_delta13 is not None:
            gu = gu + lora_delta13(tokens, e, xf[tokens])
        h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = h @ w2[e].float().T  # [n, H]
        if lora_delta2 is not None:
            y = y + lora_delta2(tokens, e, h)
        out.index_add_(0, tokens, topk_weights[tokens, ks].float()[:, None] * y)
    return out.to(x.dtype)


def ref_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``manylora.kernels.fused_moe.fused_moe`` (fp32, one loop over experts).

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(g) * u),  (g, u) = split(w13[e] @ x[t], I),
    e = topk_ids[t, k]; w13 [E, 2I, H] holds gate rows then up rows.
    """
    return _ref_moe_core(x, w13, w2, topk_ids, topk_weights)


def ref_fused_moe_lora(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: torch.Tensor,
    a13_offsets: torch.Tensor,
    b13_offsets: torch.Tensor,
    a2_offsets: torch.Tensor,
    b2_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``manylora.kernels.fused_moe_lora.fused_moe_lora_forward`` (fp32, loops over experts and slots).

    For pair (t, k), e = topk_ids[t, k], s = token_slots[t] >= 0, r = ranks[s]:
    the w13 output gains scalings[s] * concat_i(Bt13_{i,s,e}.T @ (A13_{i,s,e} @ x[t])) (slice i =
    columns [i * 2I / NS, (i + 1) * 2I / NS)) before the activation, and the w2 output gains
    scalings[s] * Bt2_{s,e}.T @ (A2_{s,e} @ h) before the routing-weighted sum. Offsets tables:
    a13/b13 [S, E, R] or [NS, S, E, R]; a2/b2 [S, E, R]; rows gathered from the flat pool.
    """
    hidden = x.shape[1]
    inter = w13.shape[1] // 2
    a13 = a13_offsets if a13_offsets.dim() == 4 else a13_offsets.unsqueeze(0)
    b13 = b13_offsets if b13_offsets.dim() == 4 else b13_offsets.unsqueeze(0)
    width13 = 2 * inter // a13.shape[0]
    slots_of = token_slots.long()

    def make_delta(a_tabs, b_tabs, in_width, out_width):
        def delta(tokens, e, inp):
            d = torch.zeros(tokens.numel(), out_width * a_tabs.shape[0], dtype=torch.float32, device=x.device)
            tok_slots = slots_of[tokens]
            for s in sorted(set(tok_slots.tolist()) - {-1}):
                sel = torch.nonzero(tok_slots == s).flatten()
                r = int(ranks[s])
                for i in range(a_tabs.shape[0]):
                    a = _gather_rows(pool, a_tabs[i, s, e, :r], in_width)  # [r, in]
                    bt = _gather_rows(pool, b_tabs[i, s, e, :r], out_width)  # [r, out]
                    d[sel, i * out_width : (i + 1) * out_width] = float(scalings[s]) * ((inp[sel] @ a.T) @ bt)
            return d

        return delta

    return _ref_moe_core(
        x, w13, w2, topk_ids, topk_weights,
        lora_delta13=make_delta(a13, b13, hidden, width13),
        lora_delta2=make_delta(a2_offsets.unsqueeze(0), b2_offsets.unsqueeze(0), inter, hidden),
    )  # fmt: skip


def ref_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``manylora.kernels.add_rms_norm.add_rms_norm``: Hugging Face's LlamaRMSNorm after the add."""
    s = x + delta if delta is not None else x
    xf = s.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out, s


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference of ``manylora.kernels.silu_mul.silu_mul``: the model's unfused ``F.silu(gate) * up``."""
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


__all__ += ["ref_rope_kv_write"]


def ref_rope_kv_write(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv: torch.Tensor, layer: int, slots: torch.Tensor, num_q_heads: int,
                      norm: torch.Tensor | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``manylora.kernels.rope_kv.rope_kv_write``: the model's torch ops (per-head RMSNorm, rotate-half
    RoPE,
    indexed KV copies) on copies; returns (rotated q heads, the KV cache after the write)."""
    x = qk
    if norm is not None:
        x = norm * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    half = x.shape[-1] // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    r = x * c + rotated * s
    kv = kv.clone()
    page_size = kv.shape[3]
    pages, offsets = slots // page_size, slots % page_size
    kv[pages, layer, 0, offsets] = r[:, num_q_heads:]
    kv[pages, layer, 1, offsets] = v
    return r[:, :num_q_heads], kv


__all__ += ["ref_skinny_linear"]


def ref_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of ``skinny_gemm.skinny_linear``: x @ weight^T + bias in fp32, rounded once to x's dtype."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

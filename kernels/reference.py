"""Plain torch references of the kernels: same signatures and in-place semantics.

Written for clarity, not speed (Python loops over slots and sequences). The tests compare the
Triton kernels against them, and the engine can use them as its CPU fallback. All arithmetic
is fp32; results are cast once to the output dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.lora_meta import SegmentMeta

__all__ = ["ref_lora_shrink", "ref_lora_expand", "ref_paged_decode_attention"]


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
    """Reference of ``kernels.lora_shrink.lora_shrink`` (``segments``/``config`` are ignored).

    out[i, t, :r] = A_{i, slot(t)} @ x[t] (fp32), out[i, t, r:] = 0; rows with slot -1 untouched.
    """
    del segments, config
    single = a_row_offsets.dim() == 2
    a3, ranks3, out3 = _as3(a_row_offsets, single), _as3(ranks, single), _as3(out, single)
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
    """Reference of ``kernels.lora_expand.lora_expand`` (``segments``/``config`` are ignored).

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
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Reference of ``kernels.paged_attention.paged_decode_attention`` (``config`` ignored)."""
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
        pages = block_tables[b, : (n + page_size - 1) // page_size].long()
        k = kv[pages, layer, 0].reshape(-1, num_kv_heads, head_dim)[:n].float()  # [n, n_kv, d]
        v = kv[pages, layer, 1].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, n_heads, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        w = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v).to(out.dtype)
    return out

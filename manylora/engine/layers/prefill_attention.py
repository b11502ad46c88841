"""Attention of the sequences a step attends in torch, many sequences per call.

Which sequences: the prefill chunks (decode rows go to the paged-attention kernel), and on the
CPU's torch path every sequence. Sequence s's new tokens are the step's rows
[start, start + length) at positions [context_len - length, context_len); they attend to the
sequence's first context_len cached keys and values (this step's included, already written),
causally, and within the sliding window if the model has one.

One call per *group* of sequences, not per sequence: queries are padded to the group's longest
chunk ([S, Lq]) and keys to its longest context ([S, Lk]), gathered straight from the pages
into [S, Lk, kv_heads, head_dim], and a boolean mask [S, 1, Lq, Lk] hides the future and the
padding. A step launches the same few ops per layer however many sequences it holds (the
per-sequence loop launched about ten per sequence per layer: an eager step of eight prefill
chunks on a 32-layer model, thousands of launches). Groups bound the padding: sequences sorted
by context join a group while S * Lq * Lk stays within PAD_RATIO times the group's real query x
key pairs (or PAD_FLOOR pairs).

Padding query rows repeat the sequence's last real row (a valid, discarded computation); padding
key positions point into the sequence's first page, are masked, and are zeroed after the gather
(the pool's pages may hold any bits there, and 0 x NaN is NaN).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from manylora.engine.layers.step_batch import SequenceSlice

PAD_RATIO = 2.0  # padded query x key pairs of a group <= this x its real pairs ...
PAD_FLOOR = 1 << 16  # ... or this many (small groups never split)
CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # not cuDNN: see attend()


@dataclass
class PrefillGroup:
    """The tables of one group, built once per step and shared by every layer."""

    q_rows: torch.Tensor  # int64 [S, Lq]: step row of each (sequence, query slot)
    k_pages: torch.Tensor  # int64 [S, Lk]: page holding each (sequence, key position)
    k_offsets: torch.Tensor  # int64 [S, Lk]: slot in that page
    mask: torch.Tensor  # bool [S, 1, Lq, Lk]: key visible to query
    k_padding: torch.Tensor  # bool [S, Lk, 1, 1]: key positions past the sequence's context
    src: torch.Tensor  # int64 [n]: flat (sequence, query slot) indices of the real rows
    dest: torch.Tensor  # int64 [n]: their step rows


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """bool [..., q, k]: key position k_pos[j] is visible to a query at q_pos[..., i] (causal, and within
    the sliding window if there is one). q_pos [..., q], k_pos [k]."""
    mask = k_pos <= q_pos[..., None]
    if sliding_window:
        mask &= k_pos > q_pos[..., None] - sliding_window
    return mask


def group_sequences(sequences: list[SequenceSlice]) -> list[list[SequenceSlice]]:
    """Sequences in groups whose padded size stays within PAD_RATIO of their real size."""
    groups: list[list[SequenceSlice]] = []
    current: list[SequenceSlice] = []
    real = max_q = max_k = 0
    for seq in sorted(sequences, key=lambda s: (s.context_len, s.length)):
        q, k = max(max_q, seq.length), max(max_k, seq.context_len)
        pairs = real + seq.length * seq.context_len
        if current and (len(current) + 1) * q * k > max(PAD_RATIO * pairs, PAD_FLOOR):
            groups.append(current)
            current, real, q, k, pairs = [], 0, seq.length, seq.context_len, seq.length * seq.context_len
        current.append(seq)
        real, max_q, max_k = pairs, q, k
    if current:
        groups.append(current)
    return groups


def build_groups(sequences: list[SequenceSlice], positions: torch.Tensor, page_size: int,
                 sliding_window: int | None) -> list[PrefillGroup]:
    """The tables of every group of the step (positions [T]: each row's position)."""
    device = positions.device
    out = []
    for group in group_sequences(sequences):
        lq = max(s.length for s in group)
        lk = max(s.context_len for s in group)
        starts = torch.tensor([s.start for s in group], dtype=torch.int64).to(device)
        lengths = torch.tensor([s.length for s in group], dtype=torch.int64).to(device)
        slot = torch.arange(lq, device=device)
        q_rows = starts[:, None] + torch.minimum(slot[None, :], lengths[:, None] - 1)  # [S, Lq]
        q_pos = positions[q_rows]
        k_pos = torch.arange(lk, device=device)
        tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in group], batch_first=True)  # [S, blocks]
        k_pages = tables[:, (k_pos // page_size).clamp(max=tables.shape[1] - 1)]  # [S, Lk]
        k_offsets = (k_pos % page_size).expand(len(group), lk)
        mask = visible(q_pos, k_pos, sliding_window)  # k < context_len follows: q_pos < context_len
        src = torch.cat([torch.arange(i * lq, i * lq + s.length) for i, s in enumerate(group)]).to(device)
        contexts = torch.tensor([s.context_len for s in group], dtype=torch.int64).to(device)
        k_padding = (k_pos[None, :] >= contexts[:, None])[:, :, None, None]
        out.append(PrefillGroup(q_rows, k_pages, k_offsets, mask[:, None], k_padding, src, q_rows.reshape(-1)[src]))
    return out


def attend(q: torch.Tensor, out: torch.Tensor, layer: int, kv_storage: torch.Tensor, groups: list[PrefillGroup],
           scale: float) -> None:
    """out[rows] = attention of q[rows] for every group's rows.

    q, out: [T, heads, head_dim]; kv_storage: [pages, layers, 2, page_size, kv_heads, head_dim].
    On CUDA, keys and values are expanded to the query heads so that torch's memory-efficient
    kernel (which takes a mask, unlike flash, and no grouped heads) runs instead of the math path
    that materialises every score. cuDNN's attention, which torch prefers on Hopper, is left out: it
    builds a graph for every new (S, Lq, Lk), about 2.3 ms of host time a call on the H200, and a
    step's group shapes are new nearly every step.
    """
    heads, kv_heads = q.shape[1], kv_storage.shape[-2]
    expand = q.is_cuda and heads != kv_heads
    with sdpa_kernel(CUDA_BACKENDS) if q.is_cuda else nullcontext():
        for g in groups:
            s, lq = g.q_rows.shape
            qs = q[g.q_rows].transpose(1, 2)  # [S, heads, Lq, d]
            # padding keys read whatever their page holds (another sequence's keys, an adapter's unused
            # page tail: any bits, NaN included); a masked NaN still poisons the weighted sum: zero them
            k = kv_storage[g.k_pages, layer, 0, g.k_offsets].masked_fill_(g.k_padding, 0)  # [S, Lk, kv_heads, d]
            v = kv_storage[g.k_pages, layer, 1, g.k_offsets].masked_fill_(g.k_padding, 0)
            if expand:
                k = k.repeat_interleave(heads // kv_heads, dim=2)
                v = v.repeat_interleave(heads // kv_heads, dim=2)
            o = F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale,
                                               enable_gqa=not expand and heads != kv_heads)
            out.index_copy_(0, g.dest, o.transpose(1, 2).reshape(s * lq, heads, -1).index_select(0, g.src))


def attend_each(q: torch.Tensor, out: torch.Tensor, layer: int, kv_storage: torch.Tensor,
                sequences: list[SequenceSlice], positions: torch.Tensor, scale: float,
                sliding_window: int | None) -> None:
    """The reference: the same attention one sequence at a time (its keys gathered page by page)."""
    for seq in sequences:
        rows = slice(seq.start, seq.start + seq.length)
        pages = kv_storage[seq.block_table, layer]  # [blocks, 2, page_size, kv_heads, d]
        k = pages[:, 0].reshape(-1, *pages.shape[-2:])[: seq.context_len]
        v = pages[:, 1].reshape(-1, *pages.shape[-2:])[: seq.context_len]
        q_pos = positions[rows]
        k_pos = torch.arange(seq.context_len, device=q.device)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible(q_pos, k_pos, sliding_window), scale=scale,
                                           enable_gqa=True)
        out[rows] = o.transpose(0, 1)

"""Expert alignment for the fused MoE kernels (the metadata step of vLLM's ``moe_align_block_size``).

A MoE layer routes each token t to K experts (``topk_ids [T, K]``). The T*K (token, k) pairs are
numbered ``pair = t * K + k`` (row-major ``topk_ids.flatten()``). The grouped GEMM kernels want
the pairs of one expert to sit together in blocks of ``block_m`` rows, so that every block uses
a single expert's weights: this module sorts the pairs by expert and pads each expert's run up
to a multiple of ``block_m`` with the sentinel pair id ``num_pairs`` (= T*K, "no pair").

Virtual experts (the LoRA pass). With ``token_slots`` (adapter slot of each token, -1 = none)
the pairs are grouped by the virtual expert id::

    virtual_id(t, k) = token_slots[t] * E + topk_ids[t, k]        (slot s in [0, S), expert e in [0, E))
    slot = virtual_id // E,  expert = virtual_id % E

so every block holds pairs that share one adapter *and* one expert: it reads one (slot, expert)
pair of LoRA matrices. Pairs whose token has slot -1 are dropped (they appear in no block). There
are S * E virtual experts.

Everything here is plain torch with no host synchronisation: the outputs have a fixed capacity
(an upper bound computed from the shapes alone); the kernels read ``num_tokens_post_padded`` on
the device and blocks at or past it exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MoeAlignment", "moe_align_block_size", "virtual_expert_ids"]


@dataclass(frozen=True)
class MoeAlignment:
    """The (token, k) pairs of one batch sorted into expert-aligned blocks.

    Attributes:
        sorted_pair_ids: int32 [max_blocks * block_m]: pair ids (``t * K + k``) grouped by expert
            (ascending expert id, pairs of one expert in ascending pair order), each expert's run
            padded to a multiple of ``block_m`` with ``num_pairs``; entries past
            ``num_tokens_post_padded`` hold ``num_pairs`` too.
        block_expert_ids: int32 [max_blocks]: the (virtual) expert of block b, which covers
            ``sorted_pair_ids[b * block_m : (b + 1) * block_m]``; -1 for blocks past the end.
        num_tokens_post_padded: int32 [1] (device): number of used entries of ``sorted_pair_ids``
            (a multiple of ``block_m``).
        num_pairs: T * K.
        top_k: K.
        block_m: block size the alignment was built for (must equal the kernel's BLOCK_M).
        max_blocks: capacity in blocks (sizes the launch grid; from shapes only).
        num_experts: number of (virtual) experts (E, or S * E for the LoRA pass).
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    num_pairs: int
    top_k: int
    block_m: int
    max_blocks: int
    num_experts: int


def virtual_expert_ids(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [T * K]: ``token_slots[t] * E + topk_ids[t, k]``, or -1 where ``token_slots[t] < 0``."""
    num_tokens, top_k = topk_ids.shape
    slots = token_slots.to(torch.int64).repeat_interleave(top_k)
    ids = topk_ids.reshape(-1).to(torch.int64)
    return torch.where(slots >= 0, slots * num_experts + ids, torch.full_like(ids, -1))


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    token_slots: torch.Tensor | None = None,
    num_slots: int | None = None,
) -> MoeAlignment:
    """Sort the (token, k) pairs by (virtual) expert into blocks of ``block_m``, padded.

    Semantics::

        ids = topk_ids.flatten()                                   # pair p = t * K + k
        if token_slots is not None:                                # LoRA pass: virtual experts
            ids = where(token_slots[p // K] >= 0, token_slots[p // K] * E + ids, DROP)
            num_ids = num_slots * E
        else:
            num_ids = E
        pos = 0
        for v in range(num_ids):
            pairs = [p for p in range(T * K) if ids[p] == v]       # ascending
            n = ceil(len(pairs) / block_m) * block_m
            sorted_pair_ids[pos : pos + n] = pairs + [T * K] * (n - len(pairs))
            block_expert_ids[pos // block_m : (pos + n) // block_m] = v
            pos += n
        num_tokens_post_padded = pos;  the rest: sorted_pair_ids = T * K, block_expert_ids = -1

    Args:
        topk_ids: int [T, K] (int32 or int64), any device: routed experts, each in [0, E)
            (not checked: that would need a host read).
        num_experts: E.
        block_m: rows per block (the grouped GEMM's BLOCK_M).
        token_slots: optional int [T]: adapter slot of each token, -1 = none (LoRA pass).
        num_slots: S, required with ``token_slots``; slots must lie in [-1, S).

    Returns:
        MoeAlignment on ``topk_ids.device``.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts <= 0 or block_m <= 0:
        raise ValueError(f"num_experts ({num_experts}) and block_m ({block_m}) must be positive")
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if token_slots is None:
        ids = topk_ids.reshape(-1).to(torch.int64)
        num_ids = num_experts
    else:
        if num_slots is None or num_slots <= 0:
            raise ValueError("num_slots (a positive int) is required with token_slots")
        if token_slots.dim() != 1 or token_slots.shape[0] != num_tokens:
            raise ValueError(f"token_slots must have shape ({num_tokens},), got {tuple(token_slots.shape)}")
        if token_slots.device != device:
            raise ValueError(f"token_slots is on {token_slots.device}, expected {device}")
        ids = virtual_expert_ids(topk_ids, token_slots, num_experts)
        num_ids = num_slots * num_experts
        ids = torch.where(ids >= 0, ids, torch.full_like(ids, num_ids))  # bucket num_ids = dropped

    # capacity: every non-empty expert wastes at most block_m - 1 padding rows
    max_padded = num_pairs + min(num_pairs, num_ids) * (block_m - 1)
    max_blocks = -(-max_padded // block_m)
    capacity = max_blocks * block_m

    counts = torch.zeros(num_ids + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_ids:].zero_()  # the dropped bucket takes no room (no host scalar: graph-capturable)
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    count_starts = torch.cumsum(counts, 0) - counts

    order = torch.sort(ids.to(torch.int32), stable=True).indices  # int32 keys: half the radix passes of int64
    sorted_ids = ids[order]
    rank_in_run = torch.arange(num_pairs, device=device) - count_starts[sorted_ids]
    dest = starts[sorted_ids] + rank_in_run
    dest = torch.where(sorted_ids < num_ids, dest, torch.full_like(dest, capacity))  # dropped: dump slot
    sorted_pair_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pair_ids.scatter_(0, dest, order)

    total = ends[num_ids - 1 : num_ids]  # [1]: padded rows of all real experts
    block_starts = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(ends[:num_ids].contiguous(), block_starts, right=True)
    block_expert = torch.where(block_starts < total, block_expert, torch.full_like(block_expert, -1))

    return MoeAlignment(
        sorted_pair_ids=sorted_pair_ids[:capacity].to(torch.int32),
        block_expert_ids=block_expert.to(torch.int32),
        num_tokens_post_padded=total.to(torch.int32),
        num_pairs=num_pairs,
        top_k=top_k,
        block_m=block_m,
        max_blocks=max_blocks,
        num_experts=num_ids,
    )

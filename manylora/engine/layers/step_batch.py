"""The tensors and metadata of one forward step over a flat batch of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceSlice:
    """One sequence's part of the step: its new tokens are batch rows [start, start+length)."""

    start: int
    length: int
    context_len: int  # tokens in the KV cache once this step's tokens are written
    block_table: torch.Tensor  # int64 [pages] on the model's device


@dataclass
class DecodeRows:
    """Rows attended in one paged-attention launch: decode tokens, and with prefill_attention="paged"
    the tokens of prefill chunks too (each attends to its sequence's cache up to its own position)."""

    rows: torch.Tensor  # int64 [B]: batch rows
    block_tables: torch.Tensor  # int32 [B, max_blocks], or [S, max_blocks] with table_rows
    seq_lens: torch.Tensor  # int32 [B]: context length including the row's token (its position + 1)
    table_rows: torch.Tensor | None = None  # int32 [B]: each row's sequence in block_tables (prefill rows)
    all_rows: bool = False  # rows is every row of the step in order (0..T-1): no gather or scatter needed


@dataclass
class StepBatch:
    """Flat token batch: T tokens from several sequences, prefill chunks and decodes mixed."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    kv_slots: torch.Tensor  # int64 [T]: page * page_size + offset where each token's k, v go
    sequences: list[SequenceSlice]  # attended in torch, grouped (prefill chunks; every sequence on the torch path)
    logits_rows: torch.Tensor  # int64 [n]: rows whose next-token logits are wanted
    decode: DecodeRows | None = None  # attended by the kernel (kernel path only)
    # Per-step tables shared by every layer; the model sets them at the start of each forward
    # (never reused across forwards: a captured CUDA graph must compute them inside the graph).
    rope_cos: torch.Tensor | None = None  # [T, 1, head_dim]
    rope_sin: torch.Tensor | None = None
    kv_pages: torch.Tensor | None = None  # int64 [T]: page of each token's k, v
    kv_offsets: torch.Tensor | None = None  # int64 [T]: slot in that page
    prefill_groups: list | None = None  # prefill_attention.PrefillGroup tables of ``sequences``

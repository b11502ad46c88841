"""Batch metadata for the segmented (SGMV) LoRA kernels.

A batch maps each token to an adapter slot (``token_slots``, -1 = base model only). The
segmented kernels want the tokens that share a slot to sit together: this module sorts the
adapter tokens by slot and describes the runs ("segments") of equal slot. Tokens stay where
they are in ``x`` and in the outputs; the kernels read and write them through ``token_order``.

Build the metadata once per batch and pass it to every layer's ``lora_shrink``/``lora_expand``:
``build_segments`` on the host (exact, one read back), or ``build_segments_on_device`` inside a
CUDA graph (tables of fixed shapes that a replay rebuilds from whatever slots it holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SegmentMeta", "build_segments", "build_segments_on_device"]


# the BLOCK_M values the launchers' heuristics choose (sgmv_block_m): 32-row tiles measured best on the H200
# (perf/kernels/bench_sgmv_prefill.py --sweep); 16 when no segment is longer
TILE_BLOCK_MS = (16, 32)


@dataclass(frozen=True)
class SegmentMeta:
    """Tokens of one batch grouped by adapter slot.

    Attributes:
        token_order: int32 [N]: original token indices, sorted by slot (stable), where N is the
            number of tokens that have an adapter. Tokens with slot -1 are left out entirely, so
            they cost no program in the segmented kernels.
        seg_starts: int32 [num_segments + 1]: segment i covers ``token_order[seg_starts[i]:seg_starts[i+1]]``.
        seg_slots: int32 [num_segments]: the slot shared by the tokens of segment i (all >= 0).
        num_segments: number of segments (one per distinct slot in the batch).
        max_seg_len: length of the longest segment (0 when there is none); sizes the launch grid.
        num_tokens: T, the number of tokens of the batch (rows of ``x``).
        seg_lens: the segments' lengths, on the host.
        slot_counts: only in tables built on the device (``build_segments_on_device``): int64 [num_segments], the
            tokens of each segment, on the device; the tile tables are then built there too, with a fixed number
            of rows (``num_tiles``), and max_seg_len is a hint for the block sizes, not a bound.
    """

    token_order: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    num_segments: int
    max_seg_len: int
    num_tokens: int
    seg_lens: tuple[int, ...] = ()
    slot_counts: torch.Tensor | None = None
    _tiles: dict = field(default_factory=dict, compare=False, repr=False)

    def tiles(self, block_m: int) -> torch.Tensor:
        """int32 [num_tiles, 2]: (segment, first row in token_order) of each BLOCK_M-row tile of every
        segment, in segment order. The segmented kernels launch one program per tile (and per column
        block), none for the rows a short segment lacks. Built once per block_m (host arithmetic,
        one copy to the device)."""
        if block_m not in self._tiles:
            if self.slot_counts is not None:
                self._tiles[block_m] = _device_tile_table(self.slot_counts, self.seg_starts, self.num_tokens, block_m)
            else:
                self._tiles.update(_tile_tables(self.seg_lens, (block_m,), self.token_order.device))
        return self._tiles[block_m]

    def config_segments(self) -> int:
        """The segment count the launchers' heuristics size K splits for: the real one, or, for tables built on the
        device (whose grouping the host does not know), as many as segments of max_seg_len tokens would make
        (the grid still covers the worst case; the tiles past the real ones exit at once)."""
        if self.slot_counts is None:
            return self.num_segments
        return min(self.num_segments, cdiv(self.num_tokens, max(1, self.max_seg_len)))

    def num_tiles(self, block_m: int) -> int:
        if self.slot_counts is not None:
            return _max_tiles(self.num_tokens, self.num_segments - 1, block_m)
        return sum(cdiv(n, block_m) for n in self.seg_lens)


def _max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """An upper bound on the BLOCK_M-row tiles of any grouping of num_tokens tokens into num_slots slots: every
    non-empty segment adds at most one partial tile to the cdiv(num_tokens, block_m) full ones."""
    return cdiv(num_tokens, block_m) + min(num_slots, num_tokens)


def _device_tile_table(slot_counts: torch.Tensor, seg_starts: torch.Tensor, num_tokens: int,
                       block_m: int) -> torch.Tensor:
    """int32 [_max_tiles, 2]: ``SegmentMeta.tiles`` of device-built segments, with torch ops of fixed shapes only
    (no host read, so a CUDA graph captures them). The last segment holds the base-only tokens and gets no tile;
    rows past the real tiles point at it, and its slot -1 makes their programs return at once."""
    num_slots = slot_counts.numel() - 1
    per_segment = (slot_counts + block_m - 1) // block_m
    per_segment.narrow(0, num_slots, 1).zero_()  # the base-only tokens' segment (a fill: no host-to-device copy)
    tile_ends = torch.cumsum(per_segment, dim=0)  # [S + 1], the last = the real tiles
    index = torch.arange(_max_tiles(num_tokens, num_slots, block_m), device=slot_counts.device)
    seg = torch.searchsorted(tile_ends, index, right=True).clamp_(max=num_slots)  # past the real tiles: S
    first_tile = (tile_ends - per_segment).index_select(0, seg)
    row = seg_starts.index_select(0, seg).to(torch.int64) + (index - first_tile) * block_m
    return torch.stack([seg, torch.where(seg < num_slots, row, 0)], dim=1).to(torch.int32).contiguous()


def _tile_tables(seg_lens: tuple[int, ...], block_ms: tuple[int, ...], device: torch.device) -> dict:
    """{block_m: int32 [num_tiles, 2] on device}, the tables in one host-to-device copy."""
    tables = []
    for block_m in block_ms:
        rows, start = [], 0
        for i, n in enumerate(seg_lens):
            rows += [(i, start + m) for m in range(0, n, block_m)]
            start += n
        tables.append(torch.tensor(rows, dtype=torch.int32).reshape(-1, 2))
    flat = torch.cat(tables).to(device) if tables else torch.empty((0, 2), dtype=torch.int32, device=device)
    out, at = {}, 0
    for block_m, table in zip(block_ms, tables, strict=True):
        out[block_m] = flat[at:at + table.shape[0]]
        at += table.shape[0]
    return out


def build_segments(token_slots: torch.Tensor, device: torch.device | str | None = None) -> SegmentMeta:
    """Group the tokens of a batch by adapter slot.

    Semantics::

        keep = nonzero(token_slots >= 0)
        token_order = keep[stable_argsort(token_slots[keep])]
        seg_slots, counts = unique_consecutive(token_slots[token_order], return_counts=True)
        seg_starts = cat([0], cumsum(counts))

    Args:
        token_slots: int [T], any device: the adapter slot of each token, -1 for none.
        device: where to put the returned tensors (default: token_slots.device).

    Returns:
        SegmentMeta, with the tile table the launchers will use (``sgmv_block_m``); another block size's
        is built on first use. The segment lengths are read back to the host
        (one synchronisation when token_slots lives on the GPU: build it from a CPU tensor when
        the scheduler has one).
    """
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype.is_floating_point or token_slots.dtype == torch.bool:
        raise TypeError(f"token_slots must be an integer tensor, got {token_slots.dtype}")
    device = token_slots.device if device is None else torch.device(device)
    num_tokens = token_slots.numel()
    slots = token_slots.to(torch.int64)

    keep = torch.nonzero(slots >= 0).flatten()
    order = keep[torch.sort(slots[keep], stable=True).indices]
    seg_slots, counts = torch.unique_consecutive(slots[order], return_counts=True)
    seg_starts = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=slots.device)
    torch.cumsum(counts, dim=0, out=seg_starts[1:])
    seg_lens = tuple(int(n) for n in counts.tolist())

    return SegmentMeta(
        token_order=order.to(device=device, dtype=torch.int32),
        seg_starts=seg_starts.to(device=device, dtype=torch.int32),
        seg_slots=seg_slots.to(device=device, dtype=torch.int32),
        num_segments=len(seg_lens),
        max_seg_len=max(seg_lens, default=0),
        num_tokens=num_tokens,
        seg_lens=seg_lens,
        _tiles=_tile_tables(seg_lens, (sgmv_block_m(max(seg_lens, default=0)),), device),
    )


def build_segments_on_device(token_slots: torch.Tensor, num_slots: int, max_seg_len: int = 16) -> SegmentMeta:
    """``build_segments`` with tables of fixed shapes, built by torch ops on token_slots' device with no read back
    to the host: what a CUDA graph can capture, so that its replays regroup whatever slots the step holds.

    Segment s < num_slots holds slot s's tokens (possibly none); segment num_slots holds the base-only tokens
    (slot -1) and gets no tile. Semantics::

        key = where(token_slots >= 0, token_slots, num_slots)
        token_order = stable_argsort(key)                           # int32 [T]: every token
        seg_starts = cat([0], cumsum(bincount(key, num_slots + 1)))  # int32 [num_slots + 2]
        seg_slots = [0, 1, ..., num_slots - 1, -1]                   # int32 [num_slots + 1]

    Args:
        token_slots: int32 [T] on the device, each in [-1, num_slots).
        num_slots: S, the slots the step's tables hold.
        max_seg_len: a hint for the launchers' block sizes (``sgmv_block_m``): the tiles are as many as the
            longest possible grouping needs (``SegmentMeta.num_tiles``), the grid with them.
    """
    if token_slots.dim() != 1 or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots must be int32 [T], got {token_slots.dtype} {tuple(token_slots.shape)}")
    device = token_slots.device
    key = torch.where(token_slots >= 0, token_slots, num_slots).to(torch.int64)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    seg_starts = torch.zeros(num_slots + 2, dtype=torch.int64, device=device)
    torch.cumsum(counts, dim=0, out=seg_starts[1:])
    seg_slots = torch.arange(num_slots + 1, dtype=torch.int32, device=device)
    # a fill, not ``seg_slots[num_slots] = -1``: item assignment copies a host scalar, which a capture refuses
    seg_slots.narrow(0, num_slots, 1).fill_(-1)
    return SegmentMeta(
        token_order=order.to(torch.int32),
        seg_starts=seg_starts.to(torch.int32),
        seg_slots=seg_slots,
        num_segments=num_slots + 1,
        max_seg_len=max_seg_len,
        num_tokens=token_slots.numel(),
        slot_counts=counts,
    )


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the LoRA launchers (private to manylora/kernels/).
# ----------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sgmv_block_m(max_seg_len: int) -> int:
    """Rows per tile of the segmented kernels: the smallest of TILE_BLOCK_MS that holds the longest
    segment, else the largest."""
    return next((m for m in TILE_BLOCK_MS if max_seg_len <= m), TILE_BLOCK_MS[-1])


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host-side arithmetic (triton.cdiv costs ~3 us a call there)."""
    return -(-a // b)


def check_tensor(name: str, t: object, *, dtype=None, dims=None, device=None) -> None:
    """Raise a ValueError/TypeError naming ``name`` when ``t`` is off."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() not in ((dims,) if isinstance(dims, int) else dims):
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in ((dtype,) if isinstance(dtype, torch.dtype) else dtype):
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def sliced_offsets(name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """MoE-LoRA row-offset table int64 [S, E, R] or [NS, S, E, R], checked; as [NS, S, E, R]."""
    check_tensor(name, t, dtype=torch.int64, dims=(3, 4), device=device)
    return t.unsqueeze(0) if t.dim() == 3 else t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_segments(segments: SegmentMeta, num_tokens: int, device: torch.device) -> None:
    if not isinstance(segments, SegmentMeta):
        raise TypeError(f"segments must be a SegmentMeta (see build_segments), got {type(segments).__name__}")
    if segments.num_tokens != num_tokens:
        raise ValueError(f"segments were built for {segments.num_tokens} tokens, the batch has {num_tokens}")
    check_tensor("segments.token_order", segments.token_order, dtype=torch.int32, dims=1, device=device)
    check_tensor("segments.seg_starts", segments.seg_starts, dtype=torch.int32, dims=1, device=device)
    check_tensor("segments.seg_slots", segments.seg_slots, dtype=torch.int32, dims=1, device=device)
    check_shape("segments.seg_starts", segments.seg_starts, (segments.num_segments + 1,))
    check_shape("segments.seg_slots", segments.seg_slots, (segments.num_segments,))

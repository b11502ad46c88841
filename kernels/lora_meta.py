"""Batch metadata for the segmented (SGMV) LoRA kernels.

A batch maps each token to an adapter slot (``token_slots``, -1 = base model only). The
segmented kernels want the tokens that share a slot to sit together: this module sorts the
adapter tokens by slot and describes the runs ("segments") of equal slot. Tokens stay where
they are in ``x`` and in the outputs; the kernels read and write them through ``token_order``.

Build the metadata once per batch and pass it to every layer's ``lora_shrink``/``lora_expand``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SegmentMeta", "build_segments"]


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
    """

    token_order: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    num_segments: int
    max_seg_len: int
    num_tokens: int


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
        SegmentMeta. Computing ``num_segments``/``max_seg_len`` reads values back to the host
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
    max_seg_len = int(counts.max().item()) if counts.numel() else 0

    return SegmentMeta(
        token_order=order.to(device=device, dtype=torch.int32),
        seg_starts=seg_starts.to(device=device, dtype=torch.int32),
        seg_slots=seg_slots.to(device=device, dtype=torch.int32),
        num_segments=int(counts.numel()),
        max_seg_len=max_seg_len,
        num_tokens=num_tokens,
    )


# ----------------------------------------------------------------------------------------------
# Argument checks shared by the LoRA launchers (private to kernels/).
# ----------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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

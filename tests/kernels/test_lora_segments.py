"""Segment tables of the segmented LoRA kernels (manylora/kernels/lora_meta.py): built on the host and, in fixed shapes,
on the device (what a CUDA-graph decode step captures)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import DISTS, seed_of, token_slots_for  # noqa: E402

from manylora.kernels.lora_meta import build_segments, build_segments_on_device  # noqa: E402


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("num_tokens", [1, 17, 64])
def test_build_segments(dist, num_tokens):
    gen = torch.Generator().manual_seed(seed_of("seg", dist, num_tokens))
    slots, _ = token_slots_for(dist, num_tokens, gen)
    meta = build_segments(slots)
    active = torch.nonzero(slots >= 0).flatten()
    order = meta.token_order.long()
    assert sorted(order.tolist()) == active.tolist(), "token_order is a permutation of the adapter tokens"
    assert meta.num_tokens == num_tokens
    assert meta.seg_starts[0] == 0 and meta.seg_starts[-1] == active.numel()
    assert meta.seg_slots.unique().numel() == meta.num_segments == (slots[active].unique().numel())
    lengths = meta.seg_starts[1:] - meta.seg_starts[:-1]
    assert (lengths > 0).all() and meta.max_seg_len == (int(lengths.max()) if meta.num_segments else 0)
    for i in range(meta.num_segments):
        toks = order[meta.seg_starts[i] : meta.seg_starts[i + 1]]
        assert (slots[toks] == meta.seg_slots[i]).all()
        assert (toks[1:] > toks[:-1]).all(), "stable: tokens keep their order inside a segment"
    assert list(meta.seg_lens) == lengths.tolist()
    for block_m in (16, 32, 64, 128):  # the up-front tables and one built on demand
        tiles = meta.tiles(block_m).tolist()
        assert len(tiles) == meta.num_tiles(block_m)
        expected = [(i, int(meta.seg_starts[i]) + m) for i in range(meta.num_segments)
                    for m in range(0, int(lengths[i]), block_m)]
        assert [tuple(t) for t in tiles] == expected, f"every segment cut into {block_m}-row tiles, in order"


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("num_tokens", [1, 17, 64])
@pytest.mark.parametrize("block_m", [16, 32])
def test_build_segments_on_device(dist, num_tokens, block_m):
    """Fixed-shape tables: every adapter token lies in exactly one tile, each tile's rows share its segment's slot,
    the padding tiles and the base-only tokens' segment have slot -1; the shapes depend on T and S only."""
    gen = torch.Generator().manual_seed(seed_of("device-seg", dist, num_tokens, block_m))
    slots, num_slots = token_slots_for(dist, num_tokens, gen)
    meta = build_segments_on_device(slots, num_slots)
    assert sorted(meta.token_order.tolist()) == list(range(num_tokens)), "token_order is a permutation of all tokens"
    assert meta.seg_starts.shape == (num_slots + 2,) and meta.seg_slots.tolist() == [*range(num_slots), -1]
    order, starts = meta.token_order.long(), meta.seg_starts.long()
    for seg in range(num_slots + 1):
        toks = order[starts[seg] : starts[seg + 1]]
        assert (slots[toks] == (seg if seg < num_slots else -1)).all()
        assert (toks[1:] > toks[:-1]).all(), "stable: tokens keep their order inside a segment"
    tiles = meta.tiles(block_m)
    assert tiles.shape == (meta.num_tiles(block_m), 2) and tiles.dtype == torch.int32
    assert meta.num_tiles(block_m) == -(-num_tokens // block_m) + min(num_slots, num_tokens)
    covered = []
    for seg, row in tiles.tolist():
        if meta.seg_slots[seg] < 0:
            continue  # a padding tile: its programs return at once
        end = int(starts[seg + 1])
        assert int(starts[seg]) <= row < end
        covered += order[row : min(row + block_m, end)].tolist()
    assert sorted(covered) == torch.nonzero(slots >= 0).flatten().tolist(), "each adapter token in one tile"


def test_device_segments_take_no_host_data():
    """The device-built tables come from torch ops on the slots alone: no host literal is lifted into a tensor
    (``t[i] = -1`` and ``torch.tensor(...)`` are), since a CUDA-graph capture refuses the host-to-device copy that
    this makes on a GPU (the H200 run of 2026-12-01 failed so before the fills). Checked on any device by
    watching the dispatcher for ``aten.lift_fresh``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoHostData(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func is not torch.ops.aten.lift_fresh.default, "a host value became a tensor"
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(seed_of("no-host-data"))
    slots, num_slots = token_slots_for("powerlaw", 40, gen)
    with NoHostData():
        meta = build_segments_on_device(slots, num_slots)
        meta.tiles(16)
        meta.tiles(32)
    assert meta.seg_slots.tolist() == [*range(num_slots), -1]
    with pytest.raises(AssertionError, match="host value"), NoHostData():
        slots[0] = -1  # the detector detects

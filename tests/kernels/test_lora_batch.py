"""manylora/engine/layers/lora_batch.py on the kernel path: one zeroed shrink scratch per forward, and graph-mode
batches whose
segments are rebuilt on the device at every forward (what a CUDA-graph replay sees)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import TOL, dense_lora, make_case, seed_of, token_slots_for  # noqa: E402


def step_tables(case, num_layers: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's [layers, 7, ...] offset / rank / scaling tables with the case's slices as q_proj, k_proj (...) of
    every layer and the other projections empty, as ``LoraBatch.from_tables`` takes them."""
    ns, num_slots, max_rank = case.a_row_offsets.shape
    row_offsets = torch.full((num_layers, 7, 2, num_slots, max_rank), -1, dtype=torch.int64, device=device)
    ranks = torch.zeros((num_layers, 7, num_slots), dtype=torch.int32, device=device)
    scalings = torch.zeros((num_layers, 7, num_slots), dtype=torch.float32, device=device)
    row_offsets[:, :ns, 0], row_offsets[:, :ns, 1] = case.a_row_offsets, case.b_row_offsets
    ranks[:, :ns], scalings[:, :ns] = case.ranks, case.scalings
    return row_offsets, ranks, scalings


def test_lora_batch_shrink_scratch(device):
    """LoraBatch's kernel path: the shrink outputs of a forward share one buffer zeroed by begin_forward (the
    split-K partial sums add into it), and a second forward over the same batch (a CUDA graph replay) starts
    from zeros again: both forwards, both layers give the dense result."""
    from manylora.engine.layers.lora_batch import LoraBatch
    from manylora.kernels.lora_config import shrink_config

    case = make_case(seed_of("scratch"), 17, 130, [40, 24], "some_none", device)
    assert shrink_config(17, 130, 16, segmented=False, num_slices=2)["SPLIT_K"] > 1, "the K splits add atomically"
    num_layers = 2
    row_offsets, ranks, scalings = step_tables(case, num_layers, device)
    lora = LoraBatch.from_tables(case.token_slots, row_offsets, ranks, scalings, case.pool)
    _, delta = dense_lora(case)
    base = torch.randn(17, 64, generator=case.gen)
    for _forward in range(2):
        lora.begin_forward(17)
        assert lora._shrink_scratch is not None and not lora._shrink_scratch.any()
        for layer in range(num_layers):
            out = base.to(device, copy=True)
            lora.apply(case.x, out, layer, ("q_proj", "k_proj"), (40, 24))
            torch.testing.assert_close(out.cpu(), base + delta, **TOL)


def test_lora_batch_deferred_expand(device, monkeypatch):
    """``expand_deferred``: the LoRA term alone in a new fp32 buffer (zero for base-only tokens), which added to the
    base output gives what the in-place expand gives; deferred only on the BGMV path and under the buffer cap."""
    import manylora.engine.layers.lora_batch as lora_batch
    from manylora.engine.layers.lora_batch import LoraBatch

    case = make_case(seed_of("deferred"), 13, 72, [40, 24], "some_none", device, align=4)
    row_offsets, ranks, scalings = step_tables(case, 1, device)
    lora = LoraBatch.from_tables(case.token_slots, row_offsets, ranks, scalings, case.pool)
    modules, widths = ("q_proj", "k_proj"), (40, 24)
    assert not lora.defers_expand(case.x, widths), "eager, outside a capture: in place"
    lora.defer_expand = True
    assert lora.defers_expand(case.x, widths)
    monkeypatch.setattr(lora_batch, "DEFER_EXPAND_MAX_BYTES", 13 * 64 * 4 - 1)
    assert not lora.defers_expand(case.x, widths), "over the buffer cap: in place"
    monkeypatch.undo()
    base = torch.randn(13, 64, generator=case.gen)
    lora.begin_forward(13)
    term = lora.expand_deferred(lora.shrink(case.x, 0, modules), widths)
    assert term.values.dtype == torch.float32 and term.values.shape == (13, 64)
    in_place = base.to(device, copy=True)
    lora.begin_forward(13)
    lora.apply(case.x, in_place, 0, modules, widths)
    got = base.to(device, copy=True)
    torch.testing.assert_close(term.add_into(got).cpu(), in_place.cpu(), rtol=1e-6, atol=1e-5)
    assert (term.values.cpu()[case.token_slots.cpu() < 0] == 0).all()
    _, delta = dense_lora(case)
    torch.testing.assert_close(got.cpu(), base + delta, **TOL)
    segmented = LoraBatch.from_tables(case.token_slots, row_offsets, ranks, scalings, case.pool, decode_form="sgmv")
    segmented.defer_expand = True
    segmented.begin_forward(13)
    assert not segmented.defers_expand(case.x, widths), "the segmented expand has no overwrite form"


@pytest.mark.parametrize("decode_form", ["sgmv", "hybrid"])
def test_lora_batch_device_segments(device, decode_form):
    """A graph-mode LoraBatch whose kernels take segments (the decode step's "sgmv" kernels, or "hybrid": the
    expand only, beside the BGMV shrink): every forward groups the
    tokens by slot on the device from the token_slots tensor as it is then, so a second forward after the slots
    were refilled in place (what a CUDA-graph replay sees) serves the new assignment, every layer equal to the
    dense result."""
    from manylora.engine.layers.lora_batch import LoraBatch

    case = make_case(seed_of("device-segments"), 21, 136, [40, 24], "some_none", device)
    num_layers = 2
    row_offsets, ranks, scalings = step_tables(case, num_layers, device)
    token_slots = case.token_slots.clone()
    lora = LoraBatch.from_tables(token_slots, row_offsets, ranks, scalings, case.pool, decode_form=decode_form)
    base = torch.randn(21, 64, generator=case.gen)
    for forward in range(2):
        if forward:  # the next step's slots, written into the same tensor
            new_slots, _ = token_slots_for("powerlaw", 21, case.gen)
            new_slots[3] = -1
            token_slots.copy_(new_slots.to(device))
            case.token_slots = token_slots
        _, delta = dense_lora(case)
        lora.begin_forward(21)
        assert lora.segments is not None and lora.segments.slot_counts is not None
        for layer in range(num_layers):
            out = base.to(device, copy=True)
            lora.apply(case.x, out, layer, ("q_proj", "k_proj"), (40, 24))
            torch.testing.assert_close(out.cpu(), base + delta, **TOL)


class _RecordingStream:
    """Stands in for a CUDA stream on the CPU: records the waits that order it, in one log shared with the tiles."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _RecordingStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event: object) -> None:
        self.log.append(f"{self.name} waits event")


@pytest.mark.parametrize("decode_form, after", [("sgmv", False), ("sgmv", True), ("hybrid", False),
                                                ("bgmv", True)])
def test_side_stream_waits_after_the_tables_it_reads(device, monkeypatch, decode_form, after):
    """A captured step's shrink on the side stream: the side stream waits for the step's stream only after the
    launch is prepared, so that a segmented launch's tile table (built by torch ops on the step's stream) is
    complete when the kernel reads it; with ``after`` (the shrink captured after its GEMM) it starts from the
    fork's event unless the preparation just built such a table. The deferred term holds the shrink's input until
    the join. (Waiting before the preparation was the cause of the segmented forms' illegal memory access on the
    H200: perf/results/2026-12-02-h200/31_race_ab.)"""
    import contextlib

    import manylora.engine.layers.lora_batch as lora_batch
    from manylora.engine.layers.lora_batch import LoraBatch
    from manylora.kernels.lora_meta import SegmentMeta

    log: list[str] = []
    main, side = _RecordingStream("main", log), _RecordingStream("side", log)
    monkeypatch.setattr(lora_batch, "_overlaps", lambda x: True)
    monkeypatch.setattr(lora_batch, "_side_stream", lambda x: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)

    @contextlib.contextmanager
    def on_stream(stream):
        log.append(f"launch on {stream.name}")
        yield

    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    tiles = SegmentMeta.tiles
    monkeypatch.setattr(SegmentMeta, "tiles", lambda self, block_m: log.append("tiles") or tiles(self, block_m))
    case = make_case(seed_of("side-stream-order"), 19, 136, [40, 24], "some_none", device)
    row_offsets, ranks, scalings = step_tables(case, 2, device)
    lora = LoraBatch.from_tables(case.token_slots, row_offsets, ranks, scalings, case.pool, decode_form=decode_form)
    modules, widths = ("q_proj", "k_proj"), (40, 24)
    _, delta = dense_lora(case)
    base = torch.randn(19, 64, generator=case.gen)
    lora.begin_forward(19)
    for layer in range(2):
        log.clear()
        pending = lora.shrink(case.x, layer, modules, after=object() if after else None)
        assert pending.x is case.x, "held until the expand joins the side stream"
        builds = decode_form == "sgmv" and layer == 0  # the first layer prepares; the next reuse the launch
        assert ("tiles" in log) is builds, log
        waits = [i for i, entry in enumerate(log) if entry.startswith("side waits")]
        assert len(waits) == 1 and log[-1] == "launch on side", log
        assert all(i < waits[0] for i, entry in enumerate(log) if entry == "tiles"), log
        assert log[waits[0]] == ("side waits event" if after and not builds else "side waits main"), log
        deferred = lora.defers_expand(case.x, widths)
        assert deferred is (decode_form == "bgmv"), "the segmented expand has no overwrite form"
        if deferred:
            term = lora.expand_deferred(pending, widths)
            assert term.x is case.x
            got = term.add_into(base.to(device, copy=True))
            assert term.x is None, "the join releases the input"
        else:
            got = base.to(device, copy=True)
            lora.expand(pending, got, widths)
        torch.testing.assert_close(got.cpu(), base + delta, **TOL)

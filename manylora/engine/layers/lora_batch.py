"""Applies each token's adapter to projections: out += scaling * (x @ A^T) @ B^T.

Adapter weights are read where they lie in the unified pool, through per-step tables of
rank-row offsets ([layer, projection, A|B, slot, rank]). Projections that share an input
(q/k/v, gate/up) go in one call, their outputs side by side in ``out``. Two paths:
"torch" gathers the rows it needs (the CPU path, and the reference); "triton" launches the
shrink/expand kernels of manylora/kernels/, which read the rows in place.

In a captured decode step (BGMV expand, LoRA side stream) a projection whose output goes straight into a fused kernel
(RoPE + KV write, residual add + RMSNorm, silu * up) takes its expand off the step's critical path: the expand runs
on the side stream after the shrink, beside the base GEMM, writing the LoRA term alone into an fp32 buffer
(``LoraDelta``), and the consuming kernel adds it, rounded as the in-place expand would have left the output.

MoE bases: slots 7 + 2e (+1) of the module axis hold expert e's gate_up_proj (down_proj) rows
(manylora/engine/adapters/packing.py); ``apply_expert`` adds them for the (token, expert) pairs routed to e,
gathering the rows in torch on either path.
"""

from __future__ import annotations

import itertools
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from manylora.engine.adapters.packing import MODULE_INDEX, expert_slot
from manylora.engine.config import check_decode_form_name
from manylora.engine.memory.adapter_slots import ResidentAdapter
from manylora.engine.model_config import PROJECTIONS

if TYPE_CHECKING:
    from manylora.kernels.lora_expand import ExpandLaunch

# Tokens per step above which the segmented (SGMV) kernels beat one program per token.
SEGMENTED_MIN_TOKENS = 64
# The shrink outputs of a whole forward ([layers, 7 projections, T, max_rank] fp32) are zeroed by one memset when
# they fit in this; larger steps (long prefills) zero each call's output instead.
SHRINK_SCRATCH_MAX_BYTES = 64 << 20


@dataclass
class PendingShrink:
    """A launched shrink (``LoraBatch.shrink``) whose expand is still to come."""

    y: torch.Tensor  # fp32 [len(modules), T, max_rank]
    layer: int
    modules: slice  # of the projection axis
    side_stream: torch.cuda.Stream | None  # where the shrink runs, when not on the current stream
    x: torch.Tensor | None = None  # the shrink's input, held while a side stream may still read it (see LoraDelta)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# Captured steps run each shrink on a side stream beside its base GEMM; MANYLORA_LORA_SIDE_STREAM=0 keeps them on the
# step's stream (perf/engine/bench_decode_step.py --lora-side-stream times both)
SIDE_STREAM = os.environ.get("MANYLORA_LORA_SIDE_STREAM", "1").strip().lower() not in ("0", "false", "off", "no")


# ... and, where the projection's consumer can add it, its expand too (LoraDelta); MANYLORA_LORA_DEFER_EXPAND=0 keeps
# every expand in place after its GEMM (perf/engine/bench_decode_step.py --defer-expand times both)
DEFER_EXPAND = os.environ.get("MANYLORA_LORA_DEFER_EXPAND", "1").strip().lower() not in ("0", "false", "off", "no")
# The deferred term's fp32 buffer stays under this: decode steps (up to 292 tokens for Llama-3-8B's gate/up, 28,672
# columns) and small mixed steps defer; a mixed step of thousands of tokens would take GBs beside the pool
# (sizing.GPU_MARGIN_BYTES is all the room the largest step's activations have) and adds in place instead.
DEFER_EXPAND_MAX_BYTES = 32 << 20
# Where the side-stream shrink's node goes in a captured step: before its base GEMM (the default), or after it, waiting
# on the point where the GEMM's input was ready, so that the GEMM is the branch launched first and the shrink's
# programs fill the SMs the GEMM leaves (before it, the shrink's grid fills the GPU and the GEMM starts when it is
# done); MANYLORA_LORA_SHRINK_AFTER_GEMM=1 (perf/engine/bench_decode_step.py --shrink-order times both)
SHRINK_AFTER_GEMM = os.environ.get("MANYLORA_LORA_SHRINK_AFTER_GEMM", "0").strip().lower() in ("1", "true", "on", "yes")


@dataclass
class LoraDelta:
    """A projection's LoRA term, computed beside its base GEMM (``LoraBatch.expand_deferred``) for the kernel that
    consumes the projection's output to add: ``scaling * (x @ A^T) @ B^T`` per token, zero in base-only tokens'
    rows."""

    values: torch.Tensor  # fp32 [T, sum(widths)]
    side_stream: torch.cuda.Stream | None  # where it is computed, when not on the current stream
    # the shrink's input until the join: the caller may drop its own reference first, and the caching allocator
    # would then hand its block to the current stream while the side stream still reads it
    x: torch.Tensor | None = None

    def ready(self) -> torch.Tensor:
        """``values``, once the current stream has waited for the side stream that writes them."""
        if self.side_stream is not None:
            torch.cuda.current_stream(self.values.device).wait_stream(self.side_stream)
            self.side_stream = None
            self.x = None
        return self.values

    def add_into(self, out: torch.Tensor) -> torch.Tensor:
        """out += the term in place (fp32 arithmetic, one rounding: the in-place expand's result); returns out."""
        return out.add_(self.ready())


def _side_stream(x: torch.Tensor) -> torch.cuda.Stream:
    """One side stream per device, for the LoRA shrinks."""
    if x.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device)
    return _SIDE_STREAMS[x.device]


def _overlaps(x: torch.Tensor) -> bool:
    """Whether the shrink of input x runs on the side stream: inside a CUDA-graph capture only. Eager steps are
    bound by the host (launches), which two stream switches per call would slow further, for no GPU-side gain."""
    return SIDE_STREAM and x.is_cuda and torch.cuda.is_current_stream_capturing()


def moe_lora_expressible(ranks: torch.Tensor, scalings: torch.Tensor) -> bool:
    """Whether the fused MoE-LoRA kernel can express adapters' expert LoRA of one layer: host ranks and scalings
    [2E, S] (expert e's gate_up at 2e, down at 2e + 1; S adapters, or [2E] for one). The kernel has one rank and one
    scaling per adapter for every expert and both parameters."""
    gate_up, down = ranks[0::2], ranks[1::2]  # [E, S]
    if not (bool((gate_up == gate_up[:1]).all()) and bool((down == down[:1]).all())):
        return False
    r13, r2 = gate_up[0], down[0]
    s13, s2 = scalings[0], scalings[1]
    used = (r13 > 0) | (r2 > 0)
    return not (bool(((r13 != r2) & used).any()) or bool(((s13 != s2) & used).any()))


class LoraBatch:
    """Which adapter slot serves each token of a step (-1: none), and the slots' tables."""

    # whether ``defers_expand`` says yes: None follows DEFER_EXPAND inside a capture with the side stream; True / False
    # force it (tests check the deferred form's numerics in eager steps, on the CPU too)
    defer_expand: bool | None = None

    def __init__(self, token_slots: list[int], adapters: list[ResidentAdapter], pool: torch.Tensor, device: str,
                 use_kernels: bool = False, decode_form: str = "bgmv") -> None:
        """decode_form (one of manylora.engine.config.DECODE_FORMS): the kernel path's LoRA kernels for a step of
        fewer than
        SEGMENTED_MIN_TOKENS tokens; larger steps take the segmented (SGMV) kernels for both halves."""
        check_decode_form_name(decode_form, "decode_form")
        self.adapters = adapters
        self.pool = pool
        self.use_kernels = use_kernels
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32, device=device)
        # [layers, 7, 2, S, R], [layers, 7, S], [layers, 7, S]
        self.row_offsets = torch.stack([a.row_offsets for a in adapters], dim=3).contiguous()
        self.ranks = torch.stack([a.ranks for a in adapters], dim=2).contiguous()
        self.scalings = torch.stack([a.scalings for a in adapters], dim=2).contiguous()
        self.max_rank = self.row_offsets.shape[-1]
        self.segments = None
        self._shrink_scratch = None
        self._moe_cache = None
        self._launches: dict[tuple, object] = {}  # prepared kernel launches, by shapes (shrink / expand)
        # (valid for every forward of this batch: its token slots, segments and pool do not change)
        self._device_segments = False
        self._graph_experts = False
        small = len(token_slots) < SEGMENTED_MIN_TOKENS
        self._bgmv_shrink = small and decode_form == "hybrid"
        self._expert_ranks_host = self.ranks[:, len(PROJECTIONS):].cpu() if self._has_expert_slots() else None
        self._expert_scalings_host = self.scalings[:, len(PROJECTIONS):].cpu() if self._has_expert_slots() else None
        if use_kernels:
            if decode_form != "bgmv" or not small:
                from manylora.kernels.lora_meta import build_segments

                self.segments = build_segments(torch.tensor(token_slots, dtype=torch.int32), device=device)
        else:
            self._ranks_host = self.ranks.cpu()
            self._scalings_host = self.scalings.cpu()
            self._rows = [torch.tensor([i for i, s in enumerate(token_slots) if s == slot], dtype=torch.int64,
                                       device=device) for slot in range(len(adapters))]

    @classmethod
    def from_tables(cls, token_slots: torch.Tensor, row_offsets: torch.Tensor, ranks: torch.Tensor,
                    scalings: torch.Tensor, pool: torch.Tensor, graph_experts: bool = False,
                    decode_form: str = "bgmv") -> LoraBatch:
        """A kernel-path batch over preallocated tables (CUDA-graph replay fills them in place). graph_experts: the
        tables hold MoE expert slots too, and every layer's experts take the fused MoE-LoRA kernel whatever the
        tables hold at replay (``has_expert_lora`` is True, ``moe_lora`` checks nothing on the host): the caller
        admits only adapters ``moe_lora_expressible`` accepts. decode_form "sgmv" or "hybrid": the LoRA kernels (both,
        or the expand only) group tokens by slot, in tables that each forward builds on the device from token_slots
        (``build_segments_on_device``), so that a replay regroups whatever slots the tables hold."""
        check_decode_form_name(decode_form, "decode_form")
        batch = cls.__new__(cls)
        batch.adapters = []
        batch.pool = pool
        batch.use_kernels = True
        batch.token_slots = token_slots
        batch.row_offsets, batch.ranks, batch.scalings = row_offsets, ranks, scalings
        batch.max_rank = row_offsets.shape[-1]
        batch.segments = None
        batch._shrink_scratch = None
        batch._moe_cache = None
        batch._launches = {}
        batch._device_segments = decode_form != "bgmv"
        batch._bgmv_shrink = decode_form == "hybrid"
        batch._graph_experts = graph_experts
        batch._expert_ranks_host = batch._expert_scalings_host = None
        return batch

    def begin_forward(self, num_tokens: int) -> None:
        """Called once at the start of each forward: one zeroed buffer for the shrink outputs of every layer (their
        split-K partial sums add into it), one memset instead of one per LoRA call. Allocated per forward, so that
        inside a CUDA-graph capture it comes from the graph's pool like the step's other temporaries. Also drops the
        MoE kernel's tables derived from the last forward's (``_moe_tables``): a replay refills the source tables in
        place, so a captured step must derive them inside the graph."""
        self._shrink_scratch = None
        self._moe_cache = None
        if not self.use_kernels:
            return
        if self._device_segments:  # new tables from this forward's token slots; launches prepared on the old ones go
            from manylora.kernels.lora_meta import build_segments_on_device

            self.segments = build_segments_on_device(self.token_slots, self.row_offsets.shape[3])
            self._launches.clear()
        # the 7 projections only (``apply``'s modules): MoE expert slots go through moe_lora / apply_expert
        shape = (self.row_offsets.shape[0], len(PROJECTIONS), num_tokens, self.max_rank)
        if shape[0] * shape[1] * num_tokens * self.max_rank * 4 <= SHRINK_SCRATCH_MAX_BYTES:
            self._shrink_scratch = torch.zeros(shape, dtype=torch.float32, device=self.pool.device)

    def _has_expert_slots(self) -> bool:
        return self.row_offsets.dim() == 5 and self.row_offsets.shape[1] > len(PROJECTIONS)

    def has_static_expert_path(self) -> bool:
        """Whether every layer's experts take the fused kernel whatever the adapters (a graph-mode batch)."""
        return self._graph_experts or not self._has_expert_slots()

    def has_expert_lora(self, layer: int) -> bool:
        """Whether any adapter of the step adapts layer's experts (a graph-mode batch: always, see from_tables)."""
        if self._graph_experts:
            return True
        ranks = self._expert_ranks_host
        return ranks is not None and bool((ranks[layer] > 0).any())

    def moe_lora(self, layer: int):
        """The layer's expert adapters as the fused MoE-LoRA kernel takes them
        (manylora.kernels.fused_moe_lora.MoeLora),
        or None when the kernel cannot express them: it has one rank and one scaling per adapter for both
        expert parameters, so an adapter whose gate_up and down ranks or scalings differ (PEFT's renamed
        transformers-4 targets give gate_up rank 2r) goes through apply_expert instead."""
        from manylora.kernels.fused_moe_lora import MoeLora

        if not self._graph_experts and not moe_lora_expressible(self._expert_ranks_host[layer],
                                                                self._expert_scalings_host[layer]):
            return None
        tables, ranks_dev, scalings_dev, token_slots = self._moe_tables()
        return MoeLora(pool=self.pool, a13_offsets=tables[layer, 0, 0], b13_offsets=tables[layer, 0, 1],
                       a2_offsets=tables[layer, 1, 0], b2_offsets=tables[layer, 1, 1], ranks=ranks_dev[layer],
                       scalings=scalings_dev[layer], token_slots=token_slots[layer])

    def _moe_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What ``moe_lora`` hands the kernel, for every layer at once, built on the device at the first call of a
        step: offset tables [layers, parameter, A|B, S, E, R], ranks [layers, S] (expert 0's gate_up rank, which
        ``moe_lora`` checks is every expert's), scalings [layers, S], token slots [layers, T] (-1 for tokens whose
        adapter leaves the layer's experts alone). No host-to-device copy: the eager MoE step is bound by the
        host, and a copy from host memory would wait for the GPU once per layer."""
        if self._moe_cache is None:
            first = len(PROJECTIONS)
            num_layers, modules, _, num_slots, max_rank = self.row_offsets.shape
            experts = (modules - first) // 2
            tables = self.row_offsets[:, first:].view(num_layers, experts, 2, 2, num_slots, max_rank)
            tables = tables.permute(0, 2, 3, 4, 1, 5).contiguous()
            ranks = self.ranks[:, first]  # [layers, S]
            slot_has = (ranks > 0) | (self.ranks[:, first + 1] > 0)
            tokens = self.token_slots.long().clamp(min=0)
            active = (self.token_slots >= 0)[None, :] & slot_has[:, tokens]
            token_slots = torch.where(active, self.token_slots[None, :], torch.full_like(self.token_slots, -1))
            self._moe_cache = (tables, ranks.clamp(min=1).contiguous(), self.scalings[:, first].contiguous(),
                               token_slots.contiguous())
        return self._moe_cache

    def apply_expert(self, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, layer: int, expert: int,
                     parameter: int) -> None:
        """Add expert ``expert``'s LoRA delta of ``parameter`` (0: gate_up_proj, 1: down_proj) into out [n, width]
        for inputs x [n, in], row i being batch token tokens[i] routed to that expert (each with its own adapter)."""
        m = expert_slot(expert, parameter)
        ranks = self._expert_ranks_host[layer, m - len(PROJECTIONS)]
        slots = self.token_slots.index_select(0, tokens)
        n_in, n_out = x.shape[1], out.shape[1]
        for slot in range(ranks.shape[0]):
            r = int(ranks[slot])
            if r == 0:
                continue
            rows = torch.nonzero(slots == slot).flatten()
            if rows.numel() == 0:
                continue
            a = self.pool[self.row_offsets[layer, m, 0, slot, :r, None] + torch.arange(n_in, device=x.device)]
            bt = self.pool[self.row_offsets[layer, m, 1, slot, :r, None] + torch.arange(n_out, device=x.device)]
            delta = (x.index_select(0, rows) @ a.t()) @ bt
            out.index_add_(0, rows, delta, alpha=float(self.scalings[layer, m, slot]))

    def apply(self, x: torch.Tensor, out: torch.Tensor, layer: int, modules: tuple[str, ...],
              widths: tuple[int, ...]) -> None:
        """Add the LoRA deltas of ``modules`` (consecutive projections sharing input x [T, in]) into
        out [T, sum(widths)], module i owning columns [sum(widths[:i]), sum(widths[:i+1]))."""
        if self.use_kernels:
            self.expand(self.shrink(x, layer, modules), out, widths)
        else:
            first, col = MODULE_INDEX[modules[0]], 0
            for i, width in enumerate(widths):
                self._apply_torch(x, out[:, col:col + width], layer, first + i)
                col += width

    def fork(self, x: torch.Tensor, gemm_first: bool = False) -> torch.cuda.Event | None:
        """Where a shrink launched after its base GEMM starts from (``SHRINK_AFTER_GEMM`` or ``gemm_first``, inside
        a capture with the side stream): an event recorded on the current stream now, where x is ready; callers
        launch the GEMM, then ``shrink(..., after=event)``. None: launch the shrink first, as usual."""
        if not ((SHRINK_AFTER_GEMM or gemm_first) and _overlaps(x)):
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(x.device))
        return event

    def shrink(self, x: torch.Tensor, layer: int, modules: tuple[str, ...],
               after: torch.cuda.Event | None = None) -> PendingShrink:
        """Kernel path, first half of ``apply``: launch the shrink of ``modules`` for input x [T, in]. It needs only x,
        so callers launch it before the base projection; inside a CUDA-graph capture it runs on a side stream, beside
        the base GEMM (the decode step's graph gets the two as parallel branches). ``expand`` joins it. ``after``
        (``fork``'s event): the side stream starts from that point instead of from the current stream's end, so the
        shrink can be captured after the GEMM and still run beside it."""
        from manylora.kernels.lora_shrink import prepare_shrink

        first, n = MODULE_INDEX[modules[0]], len(modules)
        mods = slice(first, first + n)
        scratch = self._shrink_scratch  # zeroed by begin_forward; each (layer, projection) written once a step
        if scratch is not None and scratch.shape[2] == x.shape[0]:
            y = scratch[layer, mods]
        else:
            scratch, y = None, torch.empty((n, x.shape[0], self.max_rank), dtype=torch.float32, device=x.device)
        tables, ranks = self.row_offsets[layer, mods, 0], self.ranks[layer, mods]
        # every layer launches the same shapes with this batch's slots and segments: checked and configured once
        key = ("shrink", first, n, tuple(x.shape), x.dtype, scratch is not None)
        launch = self._launches.get(key)
        built_on_device = False
        if launch is None:
            segments = None if self._bgmv_shrink else self.segments
            launch = self._launches[key] = prepare_shrink(x, self.pool, tables, ranks, self.token_slots, y,
                                                          segments=segments, out_is_zero=scratch is not None)
            # a segmented launch's tile table is built by torch ops on the current stream (SegmentMeta.tiles)
            built_on_device = segments is not None
        # the side stream waits only now, after the preparation: waiting before it, the kernel could read a tile
        # table still being built (the segmented forms' illegal memory access in captured steps: before this order 2/2
        # runs failed on the H200, after it 2/2 passed, perf/results/2026-12-02-h200/31_race_ab)
        side = _side_stream(x) if _overlaps(x) else None
        if side is not None and after is not None and not built_on_device:
            side.wait_event(after)
        elif side is not None:
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            launch.launch(x, self.pool, tables, ranks, self.token_slots, y)
        return PendingShrink(y, layer, mods, side, x if side is not None else None)

    def expand(self, pending: PendingShrink, out: torch.Tensor, widths: tuple[int, ...]) -> None:
        """Kernel path, second half of ``apply``: add the expand of a ``shrink`` into out [T, sum(widths)]."""
        if pending.side_stream is not None:
            torch.cuda.current_stream(out.device).wait_stream(pending.side_stream)
        launch, args = self._expand_launch(pending, out, widths, overwrite=False)
        launch.launch(*args)

    def defers_expand(self, x: torch.Tensor, widths: tuple[int, ...]) -> bool:
        """Whether a projection of input x and output widths may take ``expand_deferred``: the kernel path's BGMV
        expand (the only form with an overwrite mode) into at most DEFER_EXPAND_MAX_BYTES, inside a capture with the
        side stream unless ``defer_expand`` says otherwise."""
        if not self.use_kernels or self.segments is not None:
            return False
        if x.shape[0] * sum(widths) * 4 > DEFER_EXPAND_MAX_BYTES:
            return False
        if self.defer_expand is not None:
            return self.defer_expand
        return DEFER_EXPAND and _overlaps(x)

    def expand_deferred(self, pending: PendingShrink, widths: tuple[int, ...]) -> LoraDelta:
        """Kernel path, second half of ``apply`` for a consumer that adds the term itself: the expand of a ``shrink``
        written into a new fp32 [T, sum(widths)] buffer, on the shrink's stream (the side stream, beside the base
        GEMM, inside a capture). Callers check ``defers_expand`` first."""
        # allocated on the step's stream, which the side stream waited on at the shrink: no reuse race either way
        values = torch.empty((pending.y.shape[1], sum(widths)), dtype=torch.float32, device=pending.y.device)
        launch, args = self._expand_launch(pending, values, widths, overwrite=True)
        side = pending.side_stream
        with torch.cuda.stream(side) if side is not None else nullcontext():
            launch.launch(*args)
        return LoraDelta(values, side, pending.x)

    def _expand_launch(self, pending: PendingShrink, out: torch.Tensor, widths: tuple[int, ...],
                       overwrite: bool) -> tuple[ExpandLaunch, tuple[torch.Tensor, ...]]:
        """The expand of ``pending`` into out, prepared once per shapes (every layer of a step launches the same),
        and its arguments; ``overwrite``: the BGMV overwrite form (see ``lora_expand``)."""
        from manylora.kernels.lora_expand import prepare_expand

        layer, mods = pending.layer, pending.modules
        args = (pending.y, self.pool, self.row_offsets[layer, mods, 1], self.ranks[layer, mods],
                self.scalings[layer, mods], self.token_slots, out)
        key = ("expand", overwrite, mods.start, widths, tuple(out.shape), out.dtype, pending.y.shape)
        launch = self._launches.get(key)
        if launch is None:
            bounds = list(itertools.accumulate(widths, initial=0))
            launch = self._launches[key] = prepare_expand(*args, bounds, segments=None if overwrite else self.segments,
                                                          overwrite=overwrite)
        return launch, args

    def _apply_torch(self, x: torch.Tensor, out: torch.Tensor, layer: int, m: int) -> None:
        n_in, n_out = x.shape[1], out.shape[1]
        for slot in range(len(self.adapters)):
            r = int(self._ranks_host[layer, m, slot])
            rows = self._rows[slot]
            if r == 0 or rows.numel() == 0:
                continue
            a_offs = self.row_offsets[layer, m, 0, slot, :r]
            b_offs = self.row_offsets[layer, m, 1, slot, :r]
            a = self.pool[a_offs[:, None] + torch.arange(n_in, device=x.device)]  # [r, in]
            bt = self.pool[b_offs[:, None] + torch.arange(n_out, device=x.device)]  # [r, out]
            delta = (x.index_select(0, rows) @ a.t()) @ bt
            out.index_add_(0, rows, delta, alpha=float(self._scalings_host[layer, m, slot]))

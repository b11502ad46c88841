"""Lay an adapter's A and B out as rank rows in whole pages, ready to copy into the pool.

Order: layer by layer, projection by projection (PROJECTIONS order), A's r rows then B^T's
r rows; a row that would cross a page boundary starts the next page instead.

MoE bases: the module axis of the tables grows by two slots per expert, after the 7 projections:
slot ``7 + 2 * e`` is expert e's gate_up_proj (A rows of hidden, B^T rows of 2 * moe_intermediate) and
``7 + 2 * e + 1`` its down_proj; in each layer their rows follow the projections' rows, expert by expert.
Dense bases keep exactly 7 slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from manylora.engine.adapters.spec import AdapterSpec, LoraWeights
from manylora.engine.model_config import EXPERT_PARAMETERS, PROJECTIONS, ModelConfig

MODULE_INDEX = {m: i for i, m in enumerate(PROJECTIONS)}


def num_module_slots(cfg: ModelConfig) -> int:
    """Length of the module axis of the offsets tables: 7 projections, then 2 per expert on MoE bases."""
    return len(PROJECTIONS) + len(EXPERT_PARAMETERS) * cfg.num_experts


def expert_slot(expert: int, parameter: int) -> int:
    """Module-axis slot of expert e's parameter (0: gate_up_proj, 1: down_proj)."""
    return len(PROJECTIONS) + len(EXPERT_PARAMETERS) * expert + parameter


@dataclass
class PackedAdapter:
    """An adapter in pool layout, in host memory.

    ``row_offsets[l, m, 0, k]`` is where row k of A for (layer l, projection m) starts,
    counted in elements from the start of ``data``; ``[..., 1, k]`` the same for B^T;
    -1 where k >= the module's rank or the module has no adapter.
    """

    spec: AdapterSpec
    data: torch.Tensor  # [num_pages, page_elems], model dtype, host memory
    row_offsets: torch.Tensor  # int64 [layers, M, 2, max_rank], M = num_module_slots(cfg) (7 on dense bases)
    ranks: torch.Tensor  # int32 [layers, M]
    scalings: torch.Tensor  # float32 [layers, M]

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pages_for(spec: AdapterSpec, cfg: ModelConfig, page_elems: int) -> int:
    """Pages the adapter takes in the pool: ``_layout``'s count, computed a run of equal rows at a time (the engine
    thread asks it of every adapter it schedules; listing 7,000 rows of an 8B-shape adapter took ~3 ms there)."""
    page, cursor, placed = 0, 0, False
    for _layer, _slot, rank, lengths in _runs(spec, cfg, page_elems):
        placed = True
        for length in lengths:
            page, cursor = _place_run(page, cursor, rank, length, page_elems)
    return page + 1 if placed else 0


def _runs(spec: AdapterSpec, cfg: ModelConfig, page_elems: int):
    """The adapter's rank rows in pool order, a run per (layer, module slot): (layer, slot, rank, (A row length,
    B^T row length)); the layout places the run's A rows, then its B^T rows. Refuses an expert row longer than a
    page."""
    projections = [(MODULE_INDEX[m], cfg.projection_shape(m)) for m in PROJECTIONS]
    experts = [(p, parameter, cfg.expert_shape(parameter)) for p, parameter in enumerate(EXPERT_PARAMETERS)]
    for layer in range(cfg.num_layers):
        for (slot, shape), module in zip(projections, PROJECTIONS, strict=True):
            rank = spec.layer_ranks.get((layer, module), 0)
            if rank:
                yield layer, slot, rank, shape
        if not cfg.is_moe:
            continue
        _check_expert_rows(spec, cfg, layer, page_elems)
        for e in range(cfg.num_experts):
            for p, parameter, shape in experts:
                rank = spec.expert_ranks.get((layer, parameter), 0)
                if rank:
                    yield layer, expert_slot(e, p), rank, shape


def _place_run(page: int, cursor: int, count: int, length: int, page_elems: int) -> tuple[int, int]:
    """(page, cursor) after ``_layout`` places ``count`` rows of ``length`` elements from (page, cursor): a row that
    would straddle the page's end starts the next page."""
    if count == 0:
        return page, cursor
    if length > page_elems:  # each such row opens a page of its own (the expert check refuses these)
        return page + count, length
    fit = (page_elems - cursor) // length
    if count <= fit:
        return page, cursor + count * length
    per_page = page_elems // length
    full, rest = divmod(count - fit, per_page)
    if rest == 0:
        return page + full, per_page * length
    return page + full + 1, rest * length


def _layout(spec: AdapterSpec, cfg: ModelConfig, page_elems: int):
    """(pages, rows): each rank row as (layer, module slot, kind 0=A / 1=B^T, k, pool offset, length)."""
    rows = []
    page, cursor = 0, 0
    for layer, slot, rank, lengths in _runs(spec, cfg, page_elems):
        for kind, length in enumerate(lengths):
            for k in range(rank):
                if cursor + length > page_elems:  # a row never straddles two pages
                    page, cursor = page + 1, 0
                rows.append((layer, slot, kind, k, page * page_elems + cursor, length))
                cursor += length
    num_pages = page + 1 if rows else 0
    return num_pages, rows


def _check_expert_rows(spec: AdapterSpec, cfg: ModelConfig, layer: int, page_elems: int) -> None:
    for parameter in EXPERT_PARAMETERS:
        if spec.expert_ranks.get((layer, parameter), 0) and max(cfg.expert_shape(parameter)) > page_elems:
            raise ValueError(f"an expert {parameter} rank row ({max(cfg.expert_shape(parameter))} elements) is "
                             f"longer than a pool page ({page_elems}); use a larger page_size")


def row_offset_table(rows: list[tuple], cfg: ModelConfig, max_rank: int) -> torch.Tensor:
    """int64 [layers, module slots, 2, max_rank]: where each rank row of a layout (``_layout``) starts, -1
    where there is none."""
    offsets = torch.full((cfg.num_layers, num_module_slots(cfg), 2, max_rank), -1, dtype=torch.int64)
    if rows:
        index = torch.tensor([r[:4] for r in rows], dtype=torch.int64)
        offsets[index[:, 0], index[:, 1], index[:, 2], index[:, 3]] = torch.tensor([r[4] for r in rows])
    return offsets


def pack_adapter(weights: LoraWeights, cfg: ModelConfig, page_elems: int, max_rank: int,
                 pin_memory: bool = False, pause: Callable[[], None] | None = None,
                 allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None) -> PackedAdapter:
    """The adapter in pool layout; ``pause`` (if given) is called before each matrix is copied;
    ``allocate(numel, dtype)`` (if given) makes the flat tensor the pages are written into."""
    spec = weights.spec
    num_pages, rows = _layout(spec, cfg, page_elems)
    dtype = next(iter([*weights.weights.values(), *weights.expert_weights.values()]))[0].dtype
    # page space after the last row of a page is never read (the offset tables point at rows only)
    if allocate is not None:
        data = allocate(num_pages * page_elems, dtype)
    else:
        data = torch.empty(num_pages * page_elems, dtype=dtype, pin_memory=pin_memory)
    slots = num_module_slots(cfg)
    offsets = row_offset_table(rows, cfg, max_rank)
    ranks = torch.zeros((cfg.num_layers, slots), dtype=torch.int32)
    scalings = torch.zeros((cfg.num_layers, slots), dtype=torch.float32)
    for (layer, module), (a, _b, scaling) in weights.weights.items():
        m = MODULE_INDEX[module]
        ranks[layer, m] = a.shape[0]
        scalings[layer, m] = scaling
    for (layer, parameter), (a, _b, scaling) in weights.expert_weights.items():
        p = EXPERT_PARAMETERS.index(parameter)
        for e in range(cfg.num_experts):
            ranks[layer, expert_slot(e, p)] = a.shape[1]
            scalings[layer, expert_slot(e, p)] = scaling
    # Rows of one matrix sit back to back except where a page ends: copy each such run as one slice.
    block: torch.Tensor | None = None
    run_start = run_k = run_len = 0
    for layer, m, kind, k, offset, length in rows:
        if k == 0:
            if pause is not None:
                pause()
            if block is not None and run_len:
                _copy_rows(data, run_start, block, run_k, run_len)
            block = _rows_of(weights, layer, m, kind).to(dtype)
            run_start, run_k, run_len = offset, 0, 0
        elif offset != run_start + run_len * length:  # a new page: flush the run, start another
            _copy_rows(data, run_start, block, run_k, run_len)
            run_start, run_k, run_len = offset, k, 0
        run_len += 1
    if block is not None and run_len:
        _copy_rows(data, run_start, block, run_k, run_len)
    return PackedAdapter(spec, data.view(num_pages, page_elems), offsets, ranks, scalings)


def _copy_rows(data: torch.Tensor, start: int, block: torch.Tensor, first: int, count: int) -> None:
    """data[start : start + count * width] = rows first..first+count-1 of block, in one strided copy."""
    width = block.shape[1]
    data[start:start + count * width].view(count, width).copy_(block[first:first + count])


def _rows_of(weights: LoraWeights, layer: int, m: int, kind: int) -> torch.Tensor:
    """The matrix whose rows are module slot m's rank rows: A [r, in] (kind 0) or B^T [r, out] (kind 1)."""
    if m >= len(PROJECTIONS):
        e, p = divmod(m - len(PROJECTIONS), len(EXPERT_PARAMETERS))
        a, b, _ = weights.expert_weights[(layer, EXPERT_PARAMETERS[p])]
        return a[e] if kind == 0 else b[e].t()
    a, b, _ = weights.weights[(layer, PROJECTIONS[m])]
    return (a if kind == 0 else b.t()).cpu()

"""From a scheduled plan to the tensors of one step: ids, positions, KV slots, block tables,
the adapter slot of each token, or the inputs of a CUDA-graph replay."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.execution.block_tables import padded_block_tables
from manylora.engine.execution.cuda_graphs import DecodeInputs
from manylora.engine.execution.step_graphs import MixedInputs
from manylora.engine.layers.lora_batch import LoraBatch
from manylora.engine.layers.step_batch import DecodeRows, SequenceSlice, StepBatch
from manylora.engine.memory.adapter_manager import AdapterManager
from manylora.engine.memory.adapter_slots import ResidentAdapter
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.model_config import ModelConfig

if TYPE_CHECKING:  # the scheduler's plan: read here, never imported at run time (scheduling imports this)
    from manylora.engine.scheduling.scheduler import ScheduledChunk
    from manylora.engine.scheduling.sequence import Sequence


def distinct_specs(plan: list[ScheduledChunk]) -> list[AdapterSpec]:
    """The adapter versions of a step, in a fixed order (their slots)."""
    by_key = {c.sequence.adapter_key: c.sequence.spec for c in plan if c.sequence.spec}
    return [by_key[k] for k in sorted(by_key)]


def chunk_slots(plan: list[ScheduledChunk], specs: list[AdapterSpec]) -> list[int]:
    """Each chunk's adapter slot (its spec's index in ``specs``, from ``distinct_specs``), -1 for base-only."""
    slot_of = {(s.name, s.sha256): i for i, s in enumerate(specs)}
    return [slot_of[c.sequence.adapter_key] if c.sequence.spec else -1 for c in plan]


def per_token(plan: list[ScheduledChunk], values: list[int]) -> list[int]:
    """A value per chunk (its slot, its index) repeated for each of the chunk's tokens."""
    out: list[int] = []
    for c, value in zip(plan, values, strict=True):
        out += [value] * c.num_tokens
    return out


@dataclass
class StepLists:
    """Per-token and per-sequence lists of one step, before they become tensors."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first batch row of each chunk
    pages: list[list[int]] = field(default_factory=list)  # each sequence's pages (block table)
    ends: list[int] = field(default_factory=list)  # context length after the step
    logits_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)


class StepBuilder:
    """Turns a plan into a StepBatch (eager forward) or DecodeInputs (graph replay)."""

    def __init__(self, cfg: ModelConfig, kv: PagedKVCache, adapters: AdapterManager, device: str,
                 use_kernels: bool, paged_prefill: bool = False, decode_form: str = "bgmv") -> None:
        self.cfg = cfg
        self.kv = kv
        self.pool = kv.pool
        self.adapters = adapters
        self.device = device
        self.use_kernels = use_kernels
        self.paged_prefill = paged_prefill and use_kernels  # prefill chunks through the paged kernel
        self.decode_form = decode_form  # small steps' LoRA kernels (manylora/engine/config.py DECODE_FORMS)

    def adapter_slots(self, plan: list[ScheduledChunk]) -> tuple[list[int], list[ResidentAdapter]]:
        """Each chunk's adapter slot (-1 for base-only) and the slots' resident adapters, in ``distinct_specs``
        order: what every form of the step's LoRA input is built from."""
        specs = distinct_specs(plan)
        return chunk_slots(plan, specs), [self.adapters.resident(spec) for spec in specs]

    def lora_batch(self, plan: list[ScheduledChunk]) -> LoraBatch | None:
        slots, resident = self.adapter_slots(plan)
        if not resident:
            return None
        return LoraBatch(per_token(plan, slots), resident, self.pool.storage, self.device,
                         use_kernels=self.use_kernels, decode_form=self.decode_form)

    def gather(self, plan: list[ScheduledChunk]) -> StepLists:
        """Token ids, positions and KV slots of the step, and each sequence's pages."""
        lists = StepLists()
        page_size = self.kv.page_size
        for c in plan:
            seq = c.sequence
            start, end = seq.num_computed, seq.num_computed + c.num_tokens
            pages = self.pool.pages.pages_of(seq)[: self.kv.pages_needed(end)]
            lists.starts.append(len(lists.ids))
            lists.ids += seq.token_slice(start, end)
            lists.positions += range(start, end)
            lists.slots += [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
            lists.pages.append(pages)
            lists.ends.append(end)
            if end == seq.num_tokens():
                lists.logits_rows.append(len(lists.ids) - 1)
                lists.sampled.append(seq)
        return lists

    def is_decode_only(self, plan: list[ScheduledChunk]) -> bool:
        """One token per sequence, every one attended through the paged kernel (what a decode graph does)."""
        return all(c.num_tokens == 1 for c in plan) and self.pages_only(plan)

    def step_batch(self, plan: list[ScheduledChunk], lists: StepLists) -> StepBatch:
        dev = self.device
        slices: list[SequenceSlice] = []
        rows: list[int] = []
        row_lens: list[int] = []
        row_tables: list[int] = []  # paged prefill: each row's index into tables
        tables: list[list[int]] = []
        window = self.cfg.sliding_window
        for c, row0, pages, end in zip(plan, lists.starts, lists.pages, lists.ends, strict=True):
            windowed = bool(window and end > window)  # the kernel has no window: torch attends these
            if self.use_kernels and not windowed and (c.num_tokens == 1 or self.paged_prefill):
                rows += range(row0, row0 + c.num_tokens)
                row_lens += range(end - c.num_tokens + 1, end + 1)
                row_tables += [len(tables)] * c.num_tokens
                tables.append(pages)
            else:
                table = torch.tensor(pages, dtype=torch.int64, device=dev)
                slices.append(SequenceSlice(row0, c.num_tokens, end, table))
        decode = None
        if rows:
            per_sequence = len(tables) != len(rows)
            decode = DecodeRows(
                rows=torch.tensor(rows, dtype=torch.int64, device=dev),
                block_tables=padded_block_tables(tables, 0).to(dev),
                seq_lens=torch.tensor(row_lens, dtype=torch.int32, device=dev),
                table_rows=torch.tensor(row_tables, dtype=torch.int32, device=dev) if per_sequence else None,
                all_rows=not slices,  # every chunk went to the kernel: its rows are 0..T-1 in order
            )
        return StepBatch(
            input_ids=torch.tensor(lists.ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(lists.positions, dtype=torch.int64, device=dev),
            kv_slots=torch.tensor(lists.slots, dtype=torch.int64, device=dev),
            sequences=slices,
            logits_rows=torch.tensor(lists.logits_rows, dtype=torch.int64, device=dev),
            decode=decode,
        )

    def graph_inputs(self, plan: list[ScheduledChunk], lists: StepLists) -> DecodeInputs:
        slots, resident = self.adapter_slots(plan)
        return DecodeInputs(
            input_ids=torch.tensor(lists.ids, dtype=torch.int64),
            positions=torch.tensor(lists.positions, dtype=torch.int64),
            kv_slots=torch.tensor(lists.slots, dtype=torch.int64),
            block_tables=lists.pages,
            seq_lens=lists.ends,
            token_slots=slots,
            adapters=resident,
        )

    def pages_only(self, plan: list[ScheduledChunk]) -> bool:
        """Whether every token of the step can attend through the paged kernel (what a mixed-step graph does): no
        sequence past a sliding window, which torch attends."""
        window = self.cfg.sliding_window
        return not window or all(c.sequence.num_computed + c.num_tokens <= window for c in plan)

    def mixed_inputs(self, plan: list[ScheduledChunk], lists: StepLists) -> MixedInputs:
        slots, resident = self.adapter_slots(plan)
        return MixedInputs(input_ids=lists.ids, positions=lists.positions, kv_slots=lists.slots,
                           table_rows=per_token(plan, list(range(len(plan)))), block_tables=lists.pages,
                           logits_rows=lists.logits_rows, token_slots=per_token(plan, slots), adapters=resident)

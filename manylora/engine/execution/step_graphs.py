"""Mixed steps (prefill chunks and decodes together) replayed from CUDA graphs, one graph per token-count bucket.

An eager step launches about a thousand kernels of the 8B model from Python and is bound by the host: ~60 ms of
launches for ~700 tokens whose kernels take a fraction of that (``perf.engine.profile_engine``, H200, 2026-12-01). A
mixed-step graph sends every token of the step through the paged-attention kernel (each prefill token attends to
its sequence's cache up to its own position: ``prefill_attention="paged"``'s path) and through the per-token (BGMV)
LoRA kernels, so that no launch depends on the step's composition: the step is padded to its token bucket, and its
sequences' block tables, each token's sequence and adapter slot, and the rows whose logits are sampled are inputs
that a replay overwrites. Padding tokens write their KV into the reserved scratch page, attend to it alone and use
no adapter; padding logits rows repeat row 0.

Steps the graphs cannot express run eagerly: MoE bases, sequences past a sliding window (torch attends those), and
steps of more tokens or sequences than the largest bucket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from manylora.engine.execution.block_tables import padded_block_tables
from manylora.engine.execution.cuda_graphs import AdapterTables, capture_forward
from manylora.engine.layers.lora_batch import LoraBatch
from manylora.engine.layers.step_batch import DecodeRows, StepBatch
from manylora.engine.memory.adapter_slots import ResidentAdapter
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.models.llama import LlamaModel

log = logging.getLogger("manylora.step_graphs")

# the buckets captured first, whatever else memory allows (MixedStepGraphs.capture_all)
CORE_BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def token_buckets(max_tokens: int, explicit: tuple[int, ...] = ()) -> list[int]:
    """Token counts the mixed-step graphs are captured for, ascending, max_tokens always the last.

    By default every 64 tokens up to 512, then eight per doubling (every 64 to 1,024, every 128 to 2,048, every 256
    to 4,096, ...): a step is padded by less than 1/8 of its size above 512 tokens, where its GEMMs are bound by
    compute and padding costs time in proportion (with 256 requests running, a typical step is 256 decodes beside
    one prompt, ~520 tokens). ``explicit``: those counts instead (EngineConfig.mixed_step_buckets).
    """
    if explicit:
        sizes = set(explicit)
    else:
        sizes = set(range(64, 513, 64))
        t = 512
        while t < max_tokens:
            t += (1 << (t.bit_length() - 1)) // 8  # eight steps per doubling
            sizes.add(t)
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass
class MixedInputs:
    """One mixed step, real tokens and sequences only (host lists; ``MixedStepGraphs.run`` copies them in)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    kv_slots: list[int]  # [T]
    table_rows: list[int]  # [T]: each token's sequence (its row of block_tables)
    block_tables: list[list[int]]  # [S][pages]
    logits_rows: list[int]  # [n]: tokens whose next-token logits are sampled
    token_slots: list[int]  # [T]: adapter slot of each token, -1 for none
    adapters: list[ResidentAdapter]  # the slots' adapters


class MixedStepGraphs:
    """Captures and replays mixed steps of up to ``max_tokens`` tokens from up to ``max_seqs`` sequences."""

    def __init__(self, model: LlamaModel, kv: PagedKVCache, scratch_page: int, max_tokens: int, max_seqs: int,
                 max_blocks: int, max_loras: int, max_rank: int, buckets: tuple[int, ...] = ()) -> None:
        self.model, self.kv = model, kv
        dev = model.device
        self.scratch_page = scratch_page
        self.buckets = token_buckets(max_tokens, buckets)
        self.max_seqs = max_seqs
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.kv_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.table_rows = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        # one row per sequence, then the padding tokens' row: the scratch page only
        self.block_tables = torch.full((max_seqs + 1, max_blocks), scratch_page, dtype=torch.int32, device=dev)
        self.logits_rows = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        # every graph's logits, outside the graphs' pool: one [max_seqs, vocab] float32 buffer, not one per graph
        # (131 MB each for a 128k vocabulary at 256 sequences)
        self.logits = torch.empty((max_seqs, model.lm_head.shape[0]), dtype=torch.float32, device=dev)
        self.tables = AdapterTables(model.cfg, max_loras, max_rank, dev)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (graph, logits)
        self._pool = torch.cuda.graph_pool_handle() if dev.startswith("cuda") else None
        self.replays = {False: 0, True: 0}  # mixed steps replayed, without and with LoRA

    def _batch(self, size: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], kv_slots=self.kv_slots[:size],
            sequences=[], logits_rows=self.logits_rows,
            decode=DecodeRows(rows=self.rows[:size], block_tables=self.block_tables, seq_lens=self.seq_lens[:size],
                              table_rows=self.table_rows[:size], all_rows=True))

    def _lora(self, size: int) -> LoraBatch:
        t = self.tables
        return LoraBatch.from_tables(self.token_slots[:size], t.row_offsets, t.ranks, t.scalings,
                                     self.kv.pool.storage, decode_form="bgmv")

    def capture_all(self) -> None:
        """Capture every bucket, with and without LoRA, sharing one memory pool: first the coarse buckets
        (``CORE_BUCKETS`` and the largest), biggest first, then the others, biggest first. Out of memory among the
        others, the buckets captured so far are kept (steps pad to the next of those) and a warning says how many;
        out of memory among the coarse ones raises (the engine then runs mixed steps eagerly)."""
        self._reset_padding(self.buckets[-1])
        core = [b for b in self.buckets if b in CORE_BUCKETS or b == self.buckets[-1]]
        for size in reversed(core):
            self._capture(size)
        try:
            for size in reversed([b for b in self.buckets if b not in core]):
                self._capture(size)
        except torch.cuda.OutOfMemoryError:
            captured = sorted({size for size, _ in self._graphs if (size, True) in self._graphs
                               and (size, False) in self._graphs})
            log.warning("mixed steps: out of memory capturing CUDA graphs for %d token buckets; %d captured (%s), "
                        "steps pad to the next of those. Fewer KV pages (num_kv_pages, gpu_memory_fraction) or fewer "
                        "buckets (mixed_step_buckets) leave room for all", len(self.buckets), len(captured),
                        captured)
            self._graphs = {key: graph for key, graph in self._graphs.items() if key[0] in captured}
            self.buckets = captured
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        log.info("captured mixed-step graphs for %s tokens", self.buckets)

    def _capture(self, size: int) -> None:
        for with_lora in (True, False):
            self._graphs[(size, with_lora)] = capture_forward(
                self.model, self.kv, self._batch(size), self._lora(size) if with_lora else None, self._pool,
                logits_out=self.logits)

    def _reset_padding(self, size: int) -> None:
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.kv_slots[:size] = self.scratch_page * self.kv.page_size
        self.seq_lens[:size] = 1
        self.table_rows[:size] = self.max_seqs
        self.token_slots[:size] = -1
        self.logits_rows.zero_()

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.buckets[-1] and num_seqs <= self.max_seqs

    def load(self, inputs: MixedInputs) -> int:
        """Copy a step's inputs into the buffers, padding to its bucket; returns the bucket."""
        n = len(inputs.input_ids)
        size = next(b for b in self.buckets if b >= n)
        self._reset_padding(size)
        # the per-token columns in one host tensor and one copy: ids, positions, KV slots, sequence, adapter slot
        cols = torch.tensor([inputs.input_ids, inputs.positions, inputs.kv_slots, inputs.table_rows,
                             inputs.token_slots], dtype=torch.int64).to(self.input_ids.device, non_blocking=True)
        self.input_ids[:n] = cols[0]
        self.positions[:n] = cols[1]
        self.kv_slots[:n] = cols[2]
        self.seq_lens[:n] = cols[1] + 1  # each token attends up to its own position
        self.table_rows[:n] = cols[3]
        self.token_slots[:n] = cols[4]
        tables = padded_block_tables(inputs.block_tables, self.scratch_page)
        self.block_tables[: tables.shape[0], : tables.shape[1]].copy_(tables, non_blocking=True)
        k = len(inputs.logits_rows)
        self.logits_rows[:k].copy_(torch.tensor(inputs.logits_rows, dtype=torch.int64), non_blocking=True)
        if inputs.adapters:
            self.tables.fill(inputs.adapters)
        return size

    def run(self, inputs: MixedInputs) -> torch.Tensor:
        """Replay the smallest graph that holds the step; float32 logits [len(logits_rows), vocab]. The caller has
        checked ``fits`` (and that every sequence can take the paged path)."""
        size = self.load(inputs)
        with_lora = bool(inputs.adapters)
        graph, logits = self._graphs[(size, with_lora)]
        graph.replay()
        self.replays[with_lora] += 1
        return logits[: len(inputs.logits_rows)]

    def run_eager(self, inputs: MixedInputs) -> torch.Tensor:
        """``run`` without a graph: the captured step's forward over the same padded buffers (what the CPU tests
        check against the engine's eager step, under the Triton interpreter)."""
        size = self.load(inputs)
        lora = self._lora(size) if inputs.adapters else None
        return self.model.forward(self._batch(size), self.kv, lora)[: len(inputs.logits_rows)]

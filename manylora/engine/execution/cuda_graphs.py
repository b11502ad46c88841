"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (one new token per sequence) launches several hundred kernels; replaying a
captured graph removes the Python launch cost between them. Inputs live in persistent
buffers that each replay overwrites; rows past the real batch are padding that writes
its KV into a reserved scratch page and uses no adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from manylora.engine.adapters.packing import num_module_slots
from manylora.engine.config import check_decode_gemm_settings
from manylora.engine.execution.block_tables import padded_block_tables
from manylora.engine.layers.decode_gemms import DecodeGemmSettings, applied
from manylora.engine.layers.lora_batch import LoraBatch, moe_lora_expressible
from manylora.engine.layers.step_batch import DecodeRows, StepBatch
from manylora.engine.memory.adapter_slots import ResidentAdapter
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.model_config import PROJECTIONS
from manylora.engine.models.llama import LlamaModel

log = logging.getLogger("manylora.cuda_graphs")


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


@dataclass
class DecodeInputs:
    """What one decode step needs, for the real rows only (int tensors on the model's device)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_slots: torch.Tensor
    block_tables: list[list[int]]
    seq_lens: list[int]
    token_slots: list[int]
    adapters: list[ResidentAdapter]


class AdapterTables:
    """The adapter tables a captured step reads ([layer, module, A|B, slot, rank] row offsets, ranks and scalings of
    max_loras slots), filled in place before each replay. The module axis: the 7 projections, then 2 slots per
    expert on an MoE base."""

    def __init__(self, cfg, max_loras: int, max_rank: int, device: str) -> None:
        modules = num_module_slots(cfg)
        self.row_offsets = torch.full((cfg.num_layers, modules, 2, max_loras, max_rank), -1, dtype=torch.int64,
                                      device=device)
        self.ranks = torch.zeros((cfg.num_layers, modules, max_loras), dtype=torch.int32, device=device)
        self.scalings = torch.zeros((cfg.num_layers, modules, max_loras), dtype=torch.float32, device=device)

    def fill(self, adapters: list[ResidentAdapter]) -> None:
        """Slots 0..len(adapters)-1 from the adapters (device-to-device copies); later slots keep stale values,
        which no token's slot points at."""
        s = len(adapters)
        self.row_offsets[:, :, :, :s] = torch.stack([a.row_offsets for a in adapters], dim=3)
        self.ranks[:, :, :s] = torch.stack([a.ranks for a in adapters], dim=2)
        self.scalings[:, :, :s] = torch.stack([a.scalings for a in adapters], dim=2)


def capture_forward(model: LlamaModel, kv: PagedKVCache, batch: StepBatch, lora: LoraBatch | None,
                    pool, gemms: DecodeGemmSettings | None = None,
                    logits_out: torch.Tensor | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Two warm-up forwards of batch on a side stream (they compile kernels and fill launcher caches), then one
    captured into a new graph in memory pool ``pool``; returns the graph and its logits (rewritten by each replay).
    The model knows all three are for a graph (``LlamaModel.graph_forward``): the warm-ups take the kernels the
    capture will (base_gemm "auto"), so that those make their workspaces outside the capture. ``gemms``: the base
    GEMMs' cuBLAS interface and SM carveout for all three (``decode_gemms.py``; None: torch's). ``logits_out``: a
    float32 buffer outside the pool that the graph writes its logits into (``LlamaModel.logits_out``), shared by
    graphs that are never replayed at once; None: the logits live in the pool, one tensor per graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    model.graph_forward = True
    model.lora_gemm_first = gemms is not None and gemms.gemm_first
    model.lora_group_carveouts = dict(gemms.group_carveouts) if gemms is not None else None
    model.logits_out = logits_out
    try:
        with applied(gemms, model.device):
            with torch.cuda.stream(stream):
                for _ in range(2):
                    model.forward(batch, kv, lora)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = model.forward(batch, kv, lora)
    finally:
        model.graph_forward = False
        model.lora_gemm_first = False
        model.lora_group_carveouts = None
        model.logits_out = None
    return graph, logits


class DecodeGraphs:
    """Captures and replays decode steps for batch sizes up to max_batch."""

    def __init__(self, model: LlamaModel, kv: PagedKVCache, scratch_page: int, max_batch: int, max_blocks: int,
                 max_loras: int, max_rank: int, decode_form: str = "bgmv", gemm_blas: str = "cublas",
                 gemm_sm_carveout: int = 0, gemm_group_carveouts: tuple[tuple[str, int], ...] = ()) -> None:
        check_decode_gemm_settings(gemm_blas, gemm_sm_carveout, "DecodeGraphs")
        for _, sms in gemm_group_carveouts:
            check_decode_gemm_settings(gemm_blas, sms, "DecodeGraphs")
        self.model, self.kv = model, kv
        # the base GEMMs' cuBLAS interface, and the SMs they leave to the LoRA side stream in graphs with adapters
        # (manylora/engine/layers/decode_gemms.py)
        self.gemm_blas, self.gemm_sm_carveout = gemm_blas, gemm_sm_carveout
        self.gemm_group_carveouts = gemm_group_carveouts  # per projection group, in place of gemm_sm_carveout
        cfg, dev = model.cfg, model.device
        self.scratch_page = scratch_page
        self.decode_form = decode_form  # the LoRA kernels; with segments ("sgmv", "hybrid") built in the graph
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.kv_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.expert_lora = cfg.is_moe  # an MoE base's experts' LoRA is in the graph
        self.tables = AdapterTables(cfg, max_loras, max_rank, dev)
        self._expressible: dict[object, bool] = {}  # adapter key -> whether the fused MoE-LoRA kernel takes it
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (graph, logits)
        self._pool = torch.cuda.graph_pool_handle() if dev.startswith("cuda") else None
        self.replays = {False: 0, True: 0}  # decode steps replayed, without and with LoRA

    def _batch(self, size: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], kv_slots=self.kv_slots[:size],
            sequences=[], logits_rows=self.rows[:size],
            decode=DecodeRows(rows=self.rows[:size], block_tables=self.block_tables[:size],
                              seq_lens=self.seq_lens[:size], all_rows=True))

    def _lora(self, size: int) -> LoraBatch:
        t = self.tables
        return LoraBatch.from_tables(self.token_slots[:size], t.row_offsets, t.ranks, t.scalings,
                                     self.kv.pool.storage, graph_experts=self.expert_lora,
                                     decode_form=self.decode_form)

    def capture_all(self) -> None:
        """Capture every bucket, with and without LoRA (biggest first, sharing one memory pool)."""
        self._reset_padding(self.buckets[-1])
        for size in reversed(self.buckets):
            for with_lora in (True, False):
                self._capture(size, with_lora)
        log.info("captured decode graphs for batch sizes %s", self.buckets)

    def _capture(self, size: int, with_lora: bool) -> None:
        gemms = DecodeGemmSettings.for_graph(self.gemm_blas, self.gemm_sm_carveout, with_lora,
                                             self.gemm_group_carveouts)
        self._graphs[(size, with_lora)] = capture_forward(self.model, self.kv, self._batch(size),
                                                          self._lora(size) if with_lora else None, self._pool,
                                                          gemms)

    def _reset_padding(self, size: int) -> None:
        page_size = self.kv.page_size
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.kv_slots[:size] = self.scratch_page * page_size
        self.block_tables[:size] = self.scratch_page
        self.seq_lens[:size] = 1
        self.token_slots[:size] = -1

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.buckets[-1]

    def serves(self, adapters: list[ResidentAdapter]) -> bool:
        """Whether a replay can serve these adapters: on an MoE base, only those whose expert LoRA the fused kernel
        expresses in every layer (the graph runs it for every layer; the others need the eager step)."""
        if not self.expert_lora:
            return True
        first = len(PROJECTIONS)
        for a in adapters:
            if a.key not in self._expressible:
                ranks, scalings = a.ranks[:, first:].cpu(), a.scalings[:, first:].cpu()  # once per adapter
                self._expressible[a.key] = all(moe_lora_expressible(ranks[layer], scalings[layer])
                                               for layer in range(ranks.shape[0]))
                if len(self._expressible) > 4096:
                    self._expressible.clear()
            if not self._expressible[a.key]:
                return False
        return True

    def load(self, inputs: DecodeInputs) -> int:
        """Copy a decode step's inputs into the buffers, padding to the smallest bucket that holds it; returns it."""
        n = inputs.input_ids.numel()
        size = next(b for b in self.buckets if b >= n)
        self._reset_padding(size)
        self.input_ids[:n] = inputs.input_ids
        self.positions[:n] = inputs.positions
        self.kv_slots[:n] = inputs.kv_slots
        tables = padded_block_tables(inputs.block_tables, self.scratch_page)
        self.block_tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(inputs.seq_lens, dtype=torch.int32), non_blocking=True)
        if inputs.adapters:
            self.token_slots[:n].copy_(torch.tensor(inputs.token_slots, dtype=torch.int32), non_blocking=True)
            self.tables.fill(inputs.adapters)
        return size

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Replay the smallest graph that holds the batch; float32 logits [batch, vocab]. The caller has checked
        ``fits`` and ``serves``."""
        size = self.load(inputs)
        with_lora = bool(inputs.adapters)
        graph, logits = self._graphs[(size, with_lora)]
        graph.replay()
        self.replays[with_lora] += 1
        return logits[: inputs.input_ids.numel()]

    def run_eager(self, inputs: DecodeInputs) -> torch.Tensor:
        """``run`` without a graph: the captured step's forward over the same padded buffers and tables (what the CPU
        tests check against PEFT under the Triton interpreter, the segmented forms' on-device grouping included)."""
        size = self.load(inputs)
        lora = self._lora(size) if inputs.adapters else None
        return self.model.forward(self._batch(size), self.kv, lora)[: inputs.input_ids.numel()]

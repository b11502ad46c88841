"""Compile the Triton kernels before the first request, not during it.

The kernels' block sizes depend on the number of tokens in a step, and each new choice
is a new compilation (about a second each on the GPU). A first H200 run without this
spent its first ~10 s compiling while requests waited. Warm-up runs eager forward passes
with a synthetic adapter (zeros, every projection, max_lora_rank) resident in the pool
over a spread of step sizes, as prefill (one sequence) and as decode (one token each),
then gives every page back.
"""

from __future__ import annotations

import logging
import time

import torch

from backend.adapter_packing import PackedAdapter, _layout
from backend.adapter_pool import AdapterPool
from backend.kv_cache import PagedKVCache
from backend.lora_batch import LoraBatch
from backend.model_config import PROJECTIONS
from backend.models.llama import LlamaModel
from backend.sizing import synthetic_spec
from backend.step_batch import DecodeRows, SequenceSlice, StepBatch
from backend.unified_pool import ReservedPage, UnifiedPool

log = logging.getLogger("manylora.warmup")


def step_sizes(max_tokens: int) -> list[int]:
    """1..16 each, then about 1.5x apart up to max_tokens."""
    sizes = list(range(1, min(16, max_tokens) + 1))
    t = 16
    while t < max_tokens:
        t = min(max_tokens, int(t * 1.5))
        sizes.append(t)
    return sizes


def synthetic_adapter(pool: UnifiedPool, rank: int, max_rank: int) -> PackedAdapter:
    cfg = pool.cfg
    spec = synthetic_spec(cfg, rank)
    num_pages, rows = _layout(spec, cfg, pool.page_elems)
    offsets = torch.full((cfg.num_layers, len(PROJECTIONS), 2, max_rank), -1, dtype=torch.int64)
    for layer, m, kind, k, offset, _length in rows:
        offsets[layer, m, kind, k] = offset
    ranks = torch.full((cfg.num_layers, len(PROJECTIONS)), rank, dtype=torch.int32)
    data = torch.zeros(num_pages, pool.page_elems, dtype=pool.storage.dtype)
    return PackedAdapter(spec, data, offsets, ranks, torch.zeros(ranks.shape))


@torch.inference_mode()
def warm_up(model: LlamaModel, kv: PagedKVCache, max_rank: int, max_tokens: int, max_seqs: int,
            sizes: list[int] | None = None) -> float:
    """Run the kernel path over step sizes; returns seconds spent. Leaves the pool as it found it."""
    pool, device = kv.pool, model.device
    t0 = time.perf_counter()
    sizes = sizes or step_sizes(max_tokens)
    owner = ReservedPage("warm-up")
    packed = synthetic_adapter(pool, max_rank, max_rank)
    need = packed.num_pages + kv.pages_needed(max(sizes)) * 1 + max(sizes)
    if not pool.pages.can_allocate(need):
        log.warning("warm-up skipped: it needs %d free pages, the pool has %d", need, pool.pages.num_free)
        return 0.0
    adapters = AdapterPool(pool, device)
    resident = adapters.upload(packed)
    try:
        for t in sizes:
            # prefill: one sequence of t tokens (segmented kernels from 64 tokens up)
            pages = pool.pages.allocate(owner, kv.pages_needed(t))
            table = torch.tensor(pages, dtype=torch.int64, device=device)
            slots = torch.tensor([pages[p // kv.page_size] * kv.page_size + p % kv.page_size for p in range(t)],
                                 dtype=torch.int64, device=device)
            batch = StepBatch(input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                              positions=torch.arange(t, device=device), kv_slots=slots,
                              sequences=[SequenceSlice(0, t, t, table)],
                              logits_rows=torch.tensor([t - 1], device=device))
            model.forward(batch, kv, LoraBatch([0] * t, [resident], pool.storage, device, use_kernels=True))
            pool.pages.free(owner)
            if t > max_seqs:
                continue
            # decode: t sequences of one token each, mixed slots and base rows
            pages = pool.pages.allocate(owner, t)
            rows = torch.arange(t, device=device)
            page_t = torch.tensor(pages, dtype=torch.int32, device=device)
            batch = StepBatch(input_ids=torch.zeros(t, dtype=torch.int64, device=device),
                              positions=torch.zeros(t, dtype=torch.int64, device=device),
                              kv_slots=page_t.long() * kv.page_size, sequences=[], logits_rows=rows,
                              decode=DecodeRows(rows=rows, block_tables=page_t[:, None].contiguous(),
                                                seq_lens=torch.ones(t, dtype=torch.int32, device=device)))
            slots_t = [0 if i % 2 == 0 else -1 for i in range(t)]
            model.forward(batch, kv, LoraBatch(slots_t, [resident], pool.storage, device, use_kernels=True))
            pool.pages.free(owner)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    finally:
        pool.pages.free(owner)
        adapters.evict((resident.spec.name, resident.spec.sha256))
    seconds = time.perf_counter() - t0
    log.info("kernels warmed up over %d step sizes in %.1fs", len(sizes), seconds)
    return seconds

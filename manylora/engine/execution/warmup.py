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

from manylora.engine.adapters.packing import PackedAdapter, _layout, row_offset_table
from manylora.engine.layers.lora_batch import SEGMENTED_MIN_TOKENS, LoraBatch
from manylora.engine.layers.step_batch import DecodeRows, SequenceSlice, StepBatch
from manylora.engine.memory.adapter_slots import AdapterPool
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.sizing import synthetic_spec
from manylora.engine.memory.unified_pool import ReservedPage, UnifiedPool
from manylora.engine.models.llama import LlamaModel

log = logging.getLogger("manylora.warmup")


def step_sizes(max_tokens: int) -> list[int]:
    """1..64 each (the one-program-per-token kernels' block sizes follow the token count there),
    then about 1.5x apart up to max_tokens."""
    sizes = list(range(1, min(64, max_tokens) + 1))
    t = 64
    while t < max_tokens:
        t = min(max_tokens, int(t * 1.5))
        sizes.append(t)
    return sizes


def synthetic_adapter(pool: UnifiedPool, rank: int, max_rank: int, scaling: float = 0.0) -> PackedAdapter:
    """A rank-``rank`` adapter on every projection (and every expert of an MoE base) in pool layout,
    with zero weights: what the kernels read, without changing any output. Give it other ``data``
    and a name with dataclasses.replace."""
    cfg = pool.cfg
    spec = synthetic_spec(cfg, rank)
    num_pages, rows = _layout(spec, cfg, pool.page_elems)
    offsets = row_offset_table(rows, cfg, max_rank)
    ranks = torch.where(offsets[:, :, 0, 0] >= 0, rank, 0).to(torch.int32)
    data = torch.zeros(num_pages, pool.page_elems, dtype=pool.storage.dtype)
    return PackedAdapter(spec, data, offsets, ranks, torch.where(ranks > 0, scaling, 0.0))


@torch.inference_mode()
def warm_up(model: LlamaModel, kv: PagedKVCache, max_rank: int, max_tokens: int, max_seqs: int,
            sizes: list[int] | None = None, max_len: int | None = None, paged_prefill: bool = False,
            decode_form: str = "bgmv") -> float:
    """Run the kernel path over step sizes; returns seconds spent. Leaves the pool as it found it.
    decode_form: the LoRA kernels of steps under SEGMENTED_MIN_TOKENS (the engine's ``decode_lora_kernels``), so
    that the variants compiled are the ones it launches.

    A prefill step of t tokens is one sequence, or several when t exceeds ``max_len`` (the
    context: positions past it have no rotary table rows), as the scheduler would batch them.
    """
    pool, device = kv.pool, model.device
    t0 = time.perf_counter()
    sizes = sizes or step_sizes(max_tokens)
    owner = ReservedPage("warm-up")
    seq_cap = max(1, (max_len or max(sizes)) - 1)
    packed = synthetic_adapter(pool, max_rank, max_rank)
    need = packed.num_pages + kv.pages_needed(max(sizes)) * 1 + max(sizes)
    if not pool.pages.can_allocate(need):
        log.warning("warm-up skipped: it needs %d free pages, the pool has %d", need, pool.pages.num_free)
        return 0.0
    adapters = AdapterPool(pool, device)
    resident = adapters.upload(packed)
    try:
        for t in sizes:
            # prefill: t tokens in sequences of at most seq_cap (segmented kernels from 64 tokens up)
            model.forward(_prefill_batch(kv, owner, t, seq_cap, device, paged_prefill), kv,
                          LoraBatch([0] * t, [resident], pool.storage, device, use_kernels=True,
                                    decode_form=decode_form))
            pool.pages.free(owner)
            if t == SEGMENTED_MIN_TOKENS:
                # segmented kernels over short segments (their smaller row blocks): sequences of 16
                # and 32 tokens, each with its own slot
                for seq_len in (16, 32):
                    token_slots = [row // seq_len for row in range(t)]
                    model.forward(_prefill_batch(kv, owner, t, seq_len, device, paged_prefill), kv,
                                  LoraBatch(token_slots, [resident] * (t // seq_len), pool.storage, device,
                                            use_kernels=True))
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
                                                seq_lens=torch.ones(t, dtype=torch.int32, device=device),
                                                all_rows=True))
            slots_t = [0 if i % 2 == 0 else -1 for i in range(t)]
            model.forward(batch, kv, LoraBatch(slots_t, [resident], pool.storage, device, use_kernels=True,
                                               decode_form=decode_form))
            pool.pages.free(owner)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    finally:
        pool.pages.free(owner)
        adapters.evict((resident.spec.name, resident.spec.sha256))
    seconds = time.perf_counter() - t0
    log.info("kernels warmed up over %d step sizes in %.1fs", len(sizes), seconds)
    return seconds


def _prefill_batch(kv: PagedKVCache, owner: ReservedPage, num_tokens: int, seq_cap: int, device: str,
                   paged: bool = False) -> StepBatch:
    """A prefill step of num_tokens tokens: sequences of seq_cap tokens (the last one shorter), pages
    allocated to owner; attended by torch per sequence, or (paged) as rows of the paged kernel."""
    page_size = kv.page_size
    slices, slots, positions, last_rows, tables, table_rows = [], [], [], [], [], []
    row = 0
    while row < num_tokens:
        n = min(seq_cap, num_tokens - row)
        pages = kv.pool.pages.allocate(owner, kv.pages_needed(n))
        slices.append(SequenceSlice(row, n, n, torch.tensor(pages, dtype=torch.int64, device=device)))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(n)]
        positions += range(n)
        table_rows += [len(tables)] * n
        tables.append(pages)
        row += n
        last_rows.append(row - 1)
    decode = None
    if paged:
        width = max(len(t) for t in tables)
        decode = DecodeRows(rows=torch.arange(num_tokens, device=device),
                            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                                      device=device),
                            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
                            table_rows=torch.tensor(table_rows, dtype=torch.int32, device=device), all_rows=True)
        slices = []
    return StepBatch(input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
                     positions=torch.tensor(positions, dtype=torch.int64, device=device),
                     kv_slots=torch.tensor(slots, dtype=torch.int64, device=device), sequences=slices,
                     logits_rows=torch.tensor(last_rows, dtype=torch.int64, device=device), decode=decode)

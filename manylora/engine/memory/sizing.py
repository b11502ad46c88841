"""How much fits: pool pages, pages per adapter rank class, KV tokens, batch sizes.

One home for the sizing math: the engine sizes its pool with it, and the capacity planner
(python -m manylora.client plan) answers "how many adapters and how much KV fit" with it offline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from manylora.engine.adapters.packing import pages_for
from manylora.engine.adapters.spec import AdapterSpec, lora_num_parameters
from manylora.engine.memory.unified_pool import element_size, page_bytes, page_elements
from manylora.engine.model_config import (
    ATTENTION_PROJECTIONS,
    EXPERT_PARAMETERS,
    MLP_PROJECTIONS,
    PROJECTIONS,
    ModelConfig,
)

GPU_MARGIN_BYTES = 2 << 30  # left free on the GPU for the largest step's activations and CUDA graphs
CUDA_CONTEXT_BYTES = 1 << 30  # what the CUDA context and torch take before the weights (planner estimate)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the base model's weights as the engine holds them (MoE experts and routers included)."""
    attention = sum(i * o for i, o in (cfg.projection_shape(m) for m in ATTENTION_PROJECTIONS)) + 2 * cfg.hidden_size
    if cfg.qk_norm:
        attention += 2 * cfg.head_dim
    if cfg.qkv_bias:
        attention += (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    dense_mlp = sum(i * o for i, o in (cfg.projection_shape(m) for m in MLP_PROJECTIONS))
    total = 0
    for layer in range(cfg.num_layers):
        total += attention
        if cfg.is_moe and cfg.is_sparse_layer(layer):
            experts = sum(i * o for i, o in (cfg.expert_shape(p) for p in EXPERT_PARAMETERS))
            total += cfg.num_experts * (experts + cfg.hidden_size)  # experts + router rows
        else:
            total += dense_mlp
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (total + embeddings + cfg.hidden_size) * element_size(dtype)


def pool_pages_from_free(free_bytes: int, fraction: float, page_size_bytes: int,
                         margin: int = GPU_MARGIN_BYTES) -> int:
    """Pages the pool takes from what the GPU has free after the weights load."""
    return max(1, int((free_bytes * fraction - margin) // page_size_bytes))


def free_device_bytes() -> int:
    """Free bytes on the current CUDA device once memory that nothing uses is given back: an engine
    of this process that was shut down but not yet collected (a reference cycle) still holds its pool,
    and torch's caching allocator keeps freed blocks that mem_get_info does not count as free."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info()
    return free


def gpu_pool_pages(fraction: float, page_size_bytes: int, request_pages: int, adapter_pages: int,
                   what: str) -> int:
    """The engine's pool on the current GPU: ``pool_pages_from_free`` of what is free once the weights
    are loaded. Raises when that cannot hold one request of ``request_pages`` beside one adapter of
    ``adapter_pages`` (``what`` names them), rather than serving from a pool that refuses everything."""
    free = free_device_bytes()
    pages = pool_pages_from_free(free, fraction, page_size_bytes)
    needed = request_pages + adapter_pages
    if pages < needed:
        raise RuntimeError(
            f"the GPU has {free / 2**30:.1f} GiB free after the weights; a pool of {fraction:.0%} of it less "
            f"{GPU_MARGIN_BYTES / 2**30:.0f} GiB holds {pages} pages of {page_size_bytes} bytes, fewer than the "
            f"{needed} one request of {what} need: free GPU memory (other processes?), raise "
            f"gpu_memory_fraction, or lower max_model_len / max_lora_rank")
    return pages


def synthetic_spec(cfg: ModelConfig, rank: int, targets: tuple[str, ...] = PROJECTIONS,
                   experts: bool = True) -> AdapterSpec:
    """An adapter of one rank on ``targets`` of every layer (for sizing; no files). On an MoE base
    the MLP projections of sparse layers are its experts (``experts``: adapted too)."""
    layer_ranks, expert_ranks = {}, {}
    for layer in range(cfg.num_layers):
        sparse = cfg.is_moe and cfg.is_sparse_layer(layer)
        for m in targets:
            if not (sparse and m in MLP_PROJECTIONS):
                layer_ranks[(layer, m)] = rank
        if sparse and experts:
            expert_ranks.update({(layer, p): rank for p in EXPERT_PARAMETERS})
    return AdapterSpec(name=f"rank{rank}", path="", sha256="", rank=rank, ranks=dict.fromkeys(targets, rank),
                       target_modules=tuple(targets), layers=tuple(range(cfg.num_layers)),
                       scaling=dict.fromkeys(layer_ranks, 1.0), layer_ranks=layer_ranks,
                       expert_ranks=expert_ranks, expert_scaling=dict.fromkeys(expert_ranks, 1.0))


def adapter_pages(cfg: ModelConfig, rank: int, page_size: int, targets: tuple[str, ...] = PROJECTIONS) -> int:
    return pages_for(synthetic_spec(cfg, rank, targets), cfg, page_elements(cfg, page_size))


def adapter_weight_bytes(cfg: ModelConfig, rank: int, dtype: torch.dtype,
                         targets: tuple[str, ...] = PROJECTIONS) -> int:
    return lora_num_parameters(synthetic_spec(cfg, rank, targets), cfg) * element_size(dtype)


@dataclass
class RankClassPlan:
    rank: int
    count: int
    weight_bytes: int  # one adapter's A and B
    pool_pages: int  # one adapter resident in the pool
    pool_bytes: int


@dataclass
class CapacityPlan:
    gpu_memory_bytes: int
    weight_bytes: int
    page_size: int
    page_bytes: int
    pool_pages: int
    pool_bytes: int
    kv_tokens_if_no_adapters: int
    rank_classes: list[RankClassPlan]
    catalogue_pool_pages: int  # every adapter of the catalogue resident at once
    max_resident_adapters: int  # of the catalogue's mix, if KV took nothing
    hot_adapter_pages: int  # max_loras adapters of the largest rank resident
    kv_tokens_with_hot_adapters: int
    tokens_per_request: int
    max_batch: int  # requests of tokens_per_request that fit beside the hot adapters
    recommended: dict

    def as_dict(self) -> dict:
        return asdict(self)


def plan_capacity(cfg: ModelConfig, gpu_memory_bytes: int, ranks: dict[int, int], *, dtype: torch.dtype,
                  page_size: int = 16, max_loras: int = 32, prompt_len: int = 512, output_len: int = 512,
                  gpu_memory_fraction: float = 0.85, host_memory_bytes: int = 64 << 30,
                  targets: tuple[str, ...] = PROJECTIONS) -> CapacityPlan:
    """What fits on one GPU of ``gpu_memory_bytes`` for a catalogue with ``ranks`` {rank: count}."""
    weights = weight_bytes(cfg, dtype)
    free = gpu_memory_bytes - weights - CUDA_CONTEXT_BYTES
    psize = page_bytes(cfg, page_size, dtype)
    pool_pages = pool_pages_from_free(free, gpu_memory_fraction, psize) if free > 0 else 0
    classes = []
    for rank, count in sorted(ranks.items()):
        pages = adapter_pages(cfg, rank, page_size, targets)
        classes.append(RankClassPlan(rank, count, adapter_weight_bytes(cfg, rank, dtype, targets), pages,
                                     pages * psize))
    catalogue_pages = sum(c.pool_pages * c.count for c in classes)
    total = sum(c.count for c in classes)
    mean_pages = catalogue_pages / total if total else 0
    max_resident = int(pool_pages // mean_pages) if mean_pages else 0
    largest = max(classes, key=lambda c: c.pool_pages) if classes else None
    hot = min(max_loras, total) * (largest.pool_pages if largest else 0)
    kv_tokens = max(0, pool_pages - hot) * page_size
    per_request = prompt_len + output_len
    pages_per_request = -(-per_request // page_size)
    max_batch = max(0, pool_pages - hot) // pages_per_request
    host_per_adapter = max((c.pool_bytes for c in classes), default=1)
    recommended = {
        "max_loras": min(max_loras, max_resident, total) if total else max_loras,
        "max_cpu_loras": min(total, host_memory_bytes // host_per_adapter) if total else 0,
        "max_num_seqs": min(256, max_batch),
        "max_lora_rank": max(ranks) if ranks else 16,
        "page_size": page_size,
        "gpu_memory_fraction": gpu_memory_fraction,
    }
    return CapacityPlan(gpu_memory_bytes, weights, page_size, psize, pool_pages, pool_pages * psize,
                        pool_pages * page_size, classes, catalogue_pages, max_resident, hot, kv_tokens,
                        per_request, max_batch, recommended)


def memory_available_bytes() -> int | None:
    """The kernel's MemAvailable (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def host_cache_bytes(fraction: float, shared_memory_dir: str | None = None,
                     available: int | None = None) -> int | None:
    """Bytes the host tier may hold: ``fraction`` of the memory available now (None: no limit, when
    fraction <= 0 or it cannot be read), and at most 80% of the room in ``shared_memory_dir`` where
    loader processes pack adapters there (a tmpfs has a size of its own)."""
    available = memory_available_bytes() if available is None else available
    if fraction <= 0 or available is None:
        return None
    budget = int(fraction * available)
    if shared_memory_dir:
        import shutil

        budget = min(budget, int(0.8 * shutil.disk_usage(shared_memory_dir).free))
    return budget

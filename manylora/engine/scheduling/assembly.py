"""Building an engine's parts, in order: the model (or the tensor-parallel ranks and rank 0's shard), the unified pool
and its KV cache, the host adapter tier, the adapter manager, the scheduler, the step builder, then warm-up and CUDA
graph capture. A part that fails first stops what the parts before it had started (the host tier's loader threads
and processes, the GPU tier's copier, the tensor-parallel ranks), then its exception is raised.

    parts = assemble(config, model_config, device, dtype, use_kernels, max_len, catalogue, on_adapter_loaded)
    parts.model, parts.pool, parts.kv, parts.adapters, parts.scheduler, parts.steps, parts.graphs, ...
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from manylora.engine.adapters.catalogue import AdapterCatalogue
from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.process_loader import SHM_DIR, choose_directory
from manylora.engine.config import EngineConfig, ModelKernelOptions, parse_token_buckets
from manylora.engine.devices import default_load_processes
from manylora.engine.execution.cuda_graphs import DecodeGraphs
from manylora.engine.execution.step_builder import StepBuilder
from manylora.engine.execution.step_graphs import MixedStepGraphs
from manylora.engine.execution.warmup import warm_up
from manylora.engine.layers.decode_gemms import device_group_carveouts, device_sm_carveout
from manylora.engine.memory.adapter_manager import AdapterManager
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.sizing import adapter_pages, gpu_pool_pages, host_cache_bytes
from manylora.engine.memory.unified_pool import ReservedPage, UnifiedPool, page_bytes
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import LlamaModel
from manylora.engine.models.moe import MoeModel
from manylora.engine.parallel.runtime import (
    TensorParallelGroup,
    TensorParallelModel,
    TensorParallelSetup,
    new_init_file,
    rank_host_cache,
)
from manylora.engine.parallel.sharding import local_config
from manylora.engine.scheduling.scheduler import Scheduler

log = logging.getLogger("manylora.engine")

CPU_POOL_BYTES_CAP = 2 << 30  # without a GPU, the pool takes at most this much host memory


@dataclass(frozen=True)
class EngineParts:
    """What :func:`assemble` built; the engine keeps each under the same name."""

    load_processes: int  # adapter loader processes (0: loader threads), the same for every rank
    host_cache_bytes: int | None  # each rank's host tier byte limit (None: none)
    pool_config: ModelConfig  # the shapes this process's pool and model have: the whole model, or rank 0's part
    tp: TensorParallelGroup | None  # the ranks, with tensor_parallel_size > 1
    model: LlamaModel | MoeModel | TensorParallelModel
    pool: UnifiedPool
    kv: PagedKVCache
    adapters: AdapterManager
    scheduler: Scheduler
    steps: StepBuilder
    graphs: DecodeGraphs | None
    mixed_graphs: MixedStepGraphs | None


def assemble(config: EngineConfig, model_config: ModelConfig, device: str, dtype: torch.dtype, use_kernels: bool,
             max_len: int, catalogue: AdapterCatalogue,
             on_adapter_loaded: Callable[[str, float], None]) -> EngineParts:
    """Build the engine's parts in order. A failure from the model's load on first stops what was started (loaders,
    ranks: the process must exit cleanly), then is raised. ``on_adapter_loaded(name, seconds)`` is the host tier's
    callback after each adapter load."""
    cfg = model_config
    # adapter loader processes and the host tier's byte limit, resolved once for every rank
    load_processes = (config.adapter_load_processes if config.adapter_load_processes is not None
                      else default_load_processes(device))
    directory = choose_directory() if load_processes else None
    cache_bytes = host_cache_bytes(config.host_cache_fraction / config.tensor_parallel_size,
                                   directory if directory == SHM_DIR else None)
    t0 = time.perf_counter()
    tp: TensorParallelGroup | None = None
    host: HostAdapterCache | None = None
    adapters: AdapterManager | None = None
    try:  # a failure from here on first stops what was started (loaders, ranks): the process must exit cleanly
        # the shapes this process's pool and model shard have: the whole model, or tensor-parallel rank 0's part
        pool_config = cfg
        model: LlamaModel | MoeModel | TensorParallelModel
        if config.tensor_parallel_size > 1:
            pool_config, tp = _start_tensor_parallel(config, cfg, device, dtype, use_kernels, max_len, load_processes,
                                                     cache_bytes)
            model = tp.model
        else:
            model_class = MoeModel if cfg.is_moe else LlamaModel
            model = model_class.load(config.model_dir, cfg, max_len, device, dtype)
            ModelKernelOptions.of(config, use_kernels).apply_to(model)
        log.info("loaded %s (%.1f MB%s) on %s as %s in %.1fs", cfg.architecture, model.weight_bytes() / 1e6,
                 " on rank 0" if tp is not None else "", device, dtype, time.perf_counter() - t0)
        pool = UnifiedPool(pool_config, num_pages(config, pool_config, device, dtype, max_len), config.page_size,
                           dtype, device)
        kv = PagedKVCache(pool)
        if tp is not None:
            tp.start(pool.num_pages)
            host = rank_host_cache(tp.setup, cfg, 0, pool.page_elems, on_load=on_adapter_loaded)
        else:
            host = HostAdapterCache(cfg, dtype, pool.page_elems, config.max_lora_rank, config.max_cpu_loras,
                                    pin_memory=False, workers=config.adapter_load_workers, on_load=on_adapter_loaded,
                                    rehash=config.rehash_adapters, processes=load_processes, max_bytes=cache_bytes)
        adapters = AdapterManager(catalogue, pool, host, device, mirror=tp)
        _log_pool(config, pool_config, dtype, pool, adapters)
        scheduler = Scheduler(kv, adapters, config.max_num_seqs, config.max_num_batched_tokens, config.max_loras,
                              config.admit_every_steps, config.async_adapter_uploads)
        steps = StepBuilder(cfg, kv, adapters, device, use_kernels, paged_prefill=config.prefill_attention == "paged",
                            decode_form=config.decode_lora_kernels)
        # MoE: decode graphs (the fused expert kernels have static shapes), eager warm-up not written yet; tensor
        # parallelism: neither yet (every rank would have to capture and warm up in step)
        dense = not cfg.is_moe and tp is None
        if config.warmup and use_kernels and device.startswith("cuda") and dense:
            warm_up(model, kv, config.max_lora_rank, config.max_num_batched_tokens, config.max_num_seqs,
                    max_len=max_len, paged_prefill=config.prefill_attention == "paged",
                    decode_form=config.decode_lora_kernels)
        graphs: DecodeGraphs | None = None
        mixed_graphs: MixedStepGraphs | None = None
        if config.cuda_graphs and use_kernels and device.startswith("cuda") and tp is None:
            graphs, mixed_graphs = _capture_graphs(config, cfg, device, max_len, model, pool, kv)
    except BaseException:
        _stop_partial_start(host, adapters, tp)
        raise
    return EngineParts(load_processes=load_processes, host_cache_bytes=cache_bytes, pool_config=pool_config, tp=tp,
                       model=model, pool=pool, kv=kv, adapters=adapters, scheduler=scheduler, steps=steps,
                       graphs=graphs, mixed_graphs=mixed_graphs)


def _stop_partial_start(host: HostAdapterCache | None, adapters: AdapterManager | None,
                        tp: TensorParallelGroup | None) -> None:
    """After :func:`assemble` failed part-way: shut down what it had started (the host tier's loader threads and
    processes, the GPU tier's copier, the tensor-parallel ranks). A failure here is logged; the start's own
    exception is the one raised."""
    stops = [host.shutdown if host is not None else None, adapters.gpu.shutdown if adapters is not None else None,
             tp.shutdown if tp is not None else None]
    for stop in (s for s in stops if s is not None):
        try:
            stop()
        except Exception:  # noqa: BLE001 - the start's own error is the one to report
            log.exception("engine start failed, and %s failed too", stop.__qualname__)


def _start_tensor_parallel(c: EngineConfig, cfg: ModelConfig, device: str, dtype: torch.dtype, use_kernels: bool,
                           max_len: int, load_processes: int,
                           cache_bytes: int | None) -> tuple[ModelConfig, TensorParallelGroup]:
    """Spawn ranks 1.. and load rank 0's shard; returns rank 0's part of the model's shapes and the group, whose
    model (the one the engine then calls) drives them all."""
    if cfg.is_moe:
        raise ValueError(f"tensor_parallel_size {c.tensor_parallel_size}: MoE bases ({cfg.architecture}) are "
                         f"served on one GPU only for now")
    dtype_name = str(dtype).replace("torch.", "")
    setup = TensorParallelSetup(
        model_dir=c.model_dir, tp_size=c.tensor_parallel_size, device=device, dtype=dtype_name,
        max_len=max_len, page_size=c.page_size, max_lora_rank=c.max_lora_rank,
        max_cpu_loras=c.max_cpu_loras, kernels=ModelKernelOptions.of(c, use_kernels),
        rehash_adapters=c.rehash_adapters, adapter_load_workers=c.adapter_load_workers,
        adapter_load_processes=load_processes, host_cache_bytes=cache_bytes,
        init_file=new_init_file())
    pool_config = local_config(cfg, c.tensor_parallel_size)
    return pool_config, TensorParallelGroup(setup, cfg)


# ---------------------------------------------------------------------- sizing
def num_pages(c: EngineConfig, pool_config: ModelConfig, device: str, dtype: torch.dtype, max_len: int) -> int:
    """Pages in the unified pool: given, or what free memory holds less a margin."""
    size = page_bytes(pool_config, c.page_size, dtype)
    if c.num_kv_pages:
        return c.num_kv_pages
    if device.startswith("cuda"):
        return gpu_pool_pages(c.gpu_memory_fraction, size, -(-max_len // c.page_size),
                              _max_rank_adapter_pages(c, pool_config),
                              f"max_model_len {max_len} and one rank-{c.max_lora_rank} adapter")
    kv_pages = c.max_num_seqs * -(-max_len // c.page_size)
    return max(1, min(kv_pages + c.max_loras * _max_rank_adapter_pages(c, pool_config), CPU_POOL_BYTES_CAP // size))


def _max_rank_adapter_pages(c: EngineConfig, pool_config: ModelConfig) -> int:
    """Pages of an adapter of rank max_lora_rank on every projection of every layer."""
    return adapter_pages(pool_config, c.max_lora_rank, c.page_size)


def _capture_graphs(c: EngineConfig, cfg: ModelConfig, device: str, max_len: int,
                    model: LlamaModel | MoeModel, pool: UnifiedPool,
                    kv: PagedKVCache) -> tuple[DecodeGraphs | None, MixedStepGraphs | None]:
    """The decode steps' CUDA graphs and, with mixed_step_graphs, the mixed steps'; None for those that run eagerly
    (a MoE decode capture that failed, a mixed capture out of memory)."""
    t0 = time.perf_counter()
    carveout = device_sm_carveout(c.decode_gemm_sm_carveout, c.decode_gemm_blas, device)
    groups = device_group_carveouts(c.decode_gemm_group_carveouts, device)
    scratch = pool.pages.allocate(ReservedPage("cuda-graph padding"), 1)[0]
    max_blocks = kv.pages_needed(max_len)
    graphs = DecodeGraphs(model, kv, scratch, c.max_num_seqs, max_blocks, c.max_loras, c.max_lora_rank,
                          decode_form=c.decode_lora_kernels, gemm_blas=c.decode_gemm_blas, gemm_sm_carveout=carveout,
                          gemm_group_carveouts=groups)
    try:
        graphs.capture_all()
    except Exception:
        if not cfg.is_moe:
            raise
        # the MoE capture is the newer path: a failure costs its speed, not the server
        log.warning("MoE decode steps could not be captured in CUDA graphs; they run eagerly:\n%s",
                    traceback.format_exc())
        return None, None
    mixed_graphs: MixedStepGraphs | None = None
    if c.mixed_step_graphs and not cfg.is_moe:
        mixed_graphs = MixedStepGraphs(model, kv, scratch, c.max_num_batched_tokens, c.max_num_seqs, max_blocks,
                                       c.max_loras, c.max_lora_rank, parse_token_buckets(c.mixed_step_buckets))
        try:
            mixed_graphs.capture_all()
        except torch.cuda.OutOfMemoryError:  # what the pool's margin left was too little: eager steps then
            log.warning("mixed steps could not be captured in CUDA graphs (out of memory); they run eagerly:"
                        "\n%s", traceback.format_exc())
            mixed_graphs = None
            torch.cuda.empty_cache()
    log.info("CUDA graphs captured in %.1fs", time.perf_counter() - t0)
    return graphs, mixed_graphs


def _log_pool(c: EngineConfig, pool_config: ModelConfig, dtype: torch.dtype, pool: UnifiedPool,
              adapters: AdapterManager) -> None:
    mb = page_bytes(pool_config, c.page_size, dtype) / 2**20
    log.info("unified pool: %d pages of %.2f MiB (%d KV tokens each); %d KV tokens if no adapter is resident",
             pool.num_pages, mb, c.page_size, pool.num_pages * c.page_size)
    host = adapters.host
    log.info("host tier: at most %s adapters (max_cpu_loras) and %s (host_cache_fraction %.2f)",
             host.capacity if host.capacity is not None else "any number of",
             f"{host.max_bytes / 2**30:.1f} GiB" if host.max_bytes is not None else "no byte limit",
             c.host_cache_fraction)
    for rank in sorted({8, 16, 64, c.max_lora_rank}):
        if rank <= c.max_lora_rank:
            log.info("  a rank-%d adapter on all 7 projections takes %d pages",
                     rank, adapter_pages(pool_config, rank, c.page_size))

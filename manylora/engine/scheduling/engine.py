"""The engine: admits requests, runs continuous-batching steps on its own thread, emits tokens.

    engine = Engine(EngineConfig(model_dir=..., adapters={...}))
    engine.submit(GenerationRequest(...), emit)   # emit(GenerationOutput) from the engine thread
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from manylora.engine.adapters.catalogue import AdapterCatalogue
from manylora.engine.adapters.directory import AdapterDirectory
from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.process_loader import SHM_DIR, choose_directory
from manylora.engine.adapters.resolvers import load_resolvers
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.config import EngineConfig, ModelKernelOptions
from manylora.engine.devices import default_load_processes, resolve_device, resolve_kernels
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.execution.cuda_graphs import DecodeGraphs
from manylora.engine.execution.step_builder import StepBuilder, StepLists
from manylora.engine.execution.step_graphs import MixedStepGraphs
from manylora.engine.execution.warmup import warm_up
from manylora.engine.layers.decode_gemms import device_group_carveouts, device_sm_carveout
from manylora.engine.memory.adapter_manager import AdapterManager
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.sizing import adapter_pages, gpu_pool_pages, host_cache_bytes
from manylora.engine.memory.unified_pool import ReservedPage, UnifiedPool, page_bytes
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import LlamaModel
from manylora.engine.models.loader import resolve_dtype
from manylora.engine.models.moe import MoeModel
from manylora.engine.parallel.runtime import (
    TensorParallelGroup,
    TensorParallelModel,
    TensorParallelSetup,
    new_init_file,
    rank_host_cache,
)
from manylora.engine.parallel.sharding import local_config
from manylora.engine.requests.checks import check_request
from manylora.engine.requests.detokenize import IncrementalDecoder, load_tokenizer
from manylora.engine.requests.sampling import is_greedy, make_generator, sample_next
from manylora.engine.requests.types import EmitFn, GenerationOutput, GenerationRequest
from manylora.engine.scheduling.observer import EngineObserver, NullObserver
from manylora.engine.scheduling.scheduler import ScheduledChunk, Scheduler
from manylora.engine.scheduling.sequence import Sequence, Status
from manylora.engine.scheduling.state_lock import LoopStateLock

log = logging.getLogger("manylora.engine")

CPU_POOL_BYTES_CAP = 2 << 30  # without a GPU, the pool takes at most this much host memory
PREFETCH_LOOKAHEAD = 64  # waiting requests whose adapters are loaded ahead
# how often cancellation flags are read and heartbeats sent; each read of a Triton response sender's flag is a round
# trip to the server process, so not every step
CANCEL_POLL_S = 0.2


def eos_token_ids(model_dir: str, cfg: ModelConfig) -> frozenset[int]:
    """EOS ids from generation_config.json (which wins, as in transformers) or config.json."""
    ids = set(cfg.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids = set(eos) if isinstance(eos, list) else {eos}
    return frozenset(int(i) for i in ids)


def _per_adapter(sequences) -> dict[str, int]:
    """Requests per adapter name among ``sequences`` (base-model requests left out)."""
    counts: dict[str, int] = {}
    for seq in sequences:
        name = seq.adapter
        if name:
            counts[name] = counts.get(name, 0) + 1
    return counts


class Engine:
    """One base model, a catalogue of adapters, a paged KV cache, and the step loop."""

    def __init__(self, config: EngineConfig, *, start: bool = True, observer: EngineObserver | None = None,
                 on_iteration: Callable[[], None] | None = None) -> None:
        """``on_iteration`` runs on the engine thread after each pass of its loop (at least every 50 ms): where an
        engine in a process of its own sends what the pass emitted (manylora/engine/scheduling/engine_process.py)."""
        self.config = config
        self._on_iteration = on_iteration
        if config.gil_switch_interval_us > 0:
            sys.setswitchinterval(config.gil_switch_interval_us / 1e6)
        self.observer: EngineObserver = observer or NullObserver()
        self.device = resolve_device(config.device)
        if self.device.startswith("cuda") and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))
        self.model_config = ModelConfig.from_dir(config.model_dir)
        cfg = self.model_config
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.use_kernels = resolve_kernels(config.kernels, self.device)
        self.max_len = config.max_model_len or cfg.max_position_embeddings
        self.tokenizer = load_tokenizer(config.model_dir)
        self.eos_ids = eos_token_ids(config.model_dir, cfg)
        self.catalogue = AdapterCatalogue(cfg, config.max_lora_rank)
        self.catalogue.register_all(config.adapters, strict=config.strict_adapters)
        self.directory = AdapterDirectory(self.catalogue, load_resolvers(config.resolvers),
                                          config.allow_runtime_adapters, config.list_adapter_paths)
        # adapter loader processes and the host tier's byte limit, resolved once for every rank
        self.load_processes = (config.adapter_load_processes if config.adapter_load_processes is not None
                               else default_load_processes(self.device))
        directory = choose_directory() if self.load_processes else None
        self.host_cache_bytes = host_cache_bytes(config.host_cache_fraction / config.tensor_parallel_size,
                                                 directory if directory == SHM_DIR else None)
        t0 = time.perf_counter()
        self.tp: TensorParallelGroup | None = None
        host: HostAdapterCache | None = None
        try:  # a failure from here on first stops what was started (loaders, ranks): the process must exit cleanly
            # the shapes this process's pool and model shard have: the whole model, or tensor-parallel rank 0's part
            self.pool_config = cfg
            if config.tensor_parallel_size > 1:
                self.model = self._start_tensor_parallel()
            else:
                model_class = MoeModel if cfg.is_moe else LlamaModel
                self.model = model_class.load(config.model_dir, cfg, self.max_len, self.device, self.dtype)
                ModelKernelOptions.of(config, self.use_kernels).apply_to(self.model)
            log.info("loaded %s (%.1f MB%s) on %s as %s in %.1fs", cfg.architecture, self.model.weight_bytes() / 1e6,
                     " on rank 0" if self.tp else "", self.device, self.dtype, time.perf_counter() - t0)
            self.pool = UnifiedPool(self.pool_config, self._num_pages(), config.page_size, self.dtype, self.device)
            self.kv = PagedKVCache(self.pool)
            on_load = lambda name, seconds: self.observer.adapter_loaded(name, seconds)  # noqa: E731
            if self.tp is not None:
                self.tp.start(self.pool.num_pages)
                host = rank_host_cache(self.tp.setup, cfg, 0, self.pool.page_elems, on_load=on_load)
            else:
                host = HostAdapterCache(cfg, self.dtype, self.pool.page_elems, config.max_lora_rank,
                                        config.max_cpu_loras, pin_memory=False, workers=config.adapter_load_workers,
                                        on_load=on_load, rehash=config.rehash_adapters,
                                        processes=self.load_processes, max_bytes=self.host_cache_bytes)
            self.adapters = AdapterManager(self.catalogue, self.pool, host, self.device, mirror=self.tp)
            self._log_pool()
            self.scheduler = Scheduler(self.kv, self.adapters, config.max_num_seqs, config.max_num_batched_tokens,
                                       config.max_loras, config.admit_every_steps, config.async_adapter_uploads)
            self.steps = StepBuilder(cfg, self.kv, self.adapters, self.device, self.use_kernels,
                                     paged_prefill=config.prefill_attention == "paged",
                                     decode_form=config.decode_lora_kernels)
            # MoE: decode graphs (the fused expert kernels have static shapes), eager warm-up not written yet; tensor
            # parallelism: neither yet (every rank would have to capture and warm up in step)
            dense = not cfg.is_moe and self.tp is None
            if config.warmup and self.use_kernels and self.device.startswith("cuda") and dense:
                warm_up(self.model, self.kv, config.max_lora_rank, config.max_num_batched_tokens, config.max_num_seqs,
                        max_len=self.max_len, paged_prefill=config.prefill_attention == "paged",
                        decode_form=config.decode_lora_kernels)
            self.graphs: DecodeGraphs | None = None
            self.mixed_graphs: MixedStepGraphs | None = None
            if config.cuda_graphs and self.use_kernels and self.device.startswith("cuda") and self.tp is None:
                self._capture_graphs()
        except BaseException:
            self._stop_partial_start(host)
            raise
        # on a GPU the forward is launched and then awaited, and loaders use the wait; on the CPU the
        # forward is the computation itself, and shutting loaders out of it would stall loading
        self._gate_loaders = self.device.startswith("cuda")
        self._inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._state_lock = LoopStateLock()
        self._last_cancel_poll = 0.0
        self._paced_interval_s = config.stream_interval_ms / 1000  # the interval _pace_streams last gave
        self._stopping = threading.Event()
        self._counters = {"steps": 0, "requests": 0, "finished": 0, "errors": 0, "tokens_out": 0, "tokens_in": 0}
        self._refused = 0  # requests refused before they were queued (submit, or the caller's own parsing)
        self._refused_lock = threading.Lock()
        self._cancels: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()  # (request id, why) from cancel()
        self._thread = threading.Thread(target=self._loop, name="manylora-engine", daemon=True)
        if start:
            self._thread.start()

    def _stop_partial_start(self, host: HostAdapterCache | None) -> None:
        """After ``__init__`` failed part-way: shut down what it had started (the host tier's loader threads and
        processes, the GPU tier's copier, the tensor-parallel ranks). A failure here is logged; the constructor's
        own exception is the one raised."""
        adapters = getattr(self, "adapters", None)
        stops = [host.shutdown if host is not None else None, adapters.gpu.shutdown if adapters is not None else None,
                 self.tp.shutdown if self.tp is not None else None]
        for stop in (s for s in stops if s is not None):
            try:
                stop()
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                log.exception("engine start failed, and %s failed too", stop.__qualname__)

    def _start_tensor_parallel(self) -> TensorParallelModel:
        """Spawn ranks 1.. and load rank 0's shard; the model the engine then calls drives them all."""
        c, cfg = self.config, self.model_config
        if cfg.is_moe:
            raise ValueError(f"tensor_parallel_size {c.tensor_parallel_size}: MoE bases ({cfg.architecture}) are "
                             f"served on one GPU only for now")
        dtype_name = str(self.dtype).replace("torch.", "")
        setup = TensorParallelSetup(
            model_dir=c.model_dir, tp_size=c.tensor_parallel_size, device=self.device, dtype=dtype_name,
            max_len=self.max_len, page_size=c.page_size, max_lora_rank=c.max_lora_rank,
            max_cpu_loras=c.max_cpu_loras, kernels=ModelKernelOptions.of(c, self.use_kernels),
            rehash_adapters=c.rehash_adapters, adapter_load_workers=c.adapter_load_workers,
            adapter_load_processes=self.load_processes, host_cache_bytes=self.host_cache_bytes,
            init_file=new_init_file())
        self.pool_config = local_config(cfg, c.tensor_parallel_size)
        self.tp = TensorParallelGroup(setup, cfg)
        return self.tp.model

    # ------------------------------------------------------------------ sizing
    def _num_pages(self) -> int:
        """Pages in the unified pool: given, or what free memory holds less a margin."""
        cfg, c = self.pool_config, self.config
        size = page_bytes(cfg, c.page_size, self.dtype)
        if c.num_kv_pages:
            return c.num_kv_pages
        if self.device.startswith("cuda"):
            return gpu_pool_pages(c.gpu_memory_fraction, size, -(-self.max_len // c.page_size),
                                  self._max_rank_adapter_pages(),
                                  f"max_model_len {self.max_len} and one rank-{c.max_lora_rank} adapter")
        kv_pages = c.max_num_seqs * -(-self.max_len // c.page_size)
        return max(1, min(kv_pages + c.max_loras * self._max_rank_adapter_pages(), CPU_POOL_BYTES_CAP // size))

    def _max_rank_adapter_pages(self) -> int:
        """Pages of an adapter of rank max_lora_rank on every projection of every layer."""
        return adapter_pages(self.pool_config, self.config.max_lora_rank, self.config.page_size)

    def _capture_graphs(self) -> None:
        t0 = time.perf_counter()
        c = self.config
        carveout = device_sm_carveout(c.decode_gemm_sm_carveout, c.decode_gemm_blas, self.device)
        groups = device_group_carveouts(c.decode_gemm_group_carveouts, self.device)
        scratch = self.pool.pages.allocate(ReservedPage("cuda-graph padding"), 1)[0]
        max_blocks = self.kv.pages_needed(self.max_len)
        self.graphs = DecodeGraphs(self.model, self.kv, scratch, c.max_num_seqs, max_blocks, c.max_loras,
                                   c.max_lora_rank, decode_form=c.decode_lora_kernels, gemm_blas=c.decode_gemm_blas,
                                   gemm_sm_carveout=carveout, gemm_group_carveouts=groups)
        try:
            self.graphs.capture_all()
        except Exception:
            if not self.model_config.is_moe:
                raise
            # the MoE capture is the newer path: a failure costs its speed, not the server
            log.warning("MoE decode steps could not be captured in CUDA graphs; they run eagerly:\n%s",
                        traceback.format_exc())
            self.graphs = None
            return
        if self.config.mixed_step_graphs and not self.model_config.is_moe:
            self.mixed_graphs = MixedStepGraphs(self.model, self.kv, scratch, self.config.max_num_batched_tokens,
                                                self.config.max_num_seqs, max_blocks, self.config.max_loras,
                                                self.config.max_lora_rank)
            try:
                self.mixed_graphs.capture_all()
            except torch.cuda.OutOfMemoryError:  # what the pool's margin left was too little: eager steps then
                log.warning("mixed steps could not be captured in CUDA graphs (out of memory); they run eagerly:"
                            "\n%s", traceback.format_exc())
                self.mixed_graphs = None
                torch.cuda.empty_cache()
        log.info("CUDA graphs captured in %.1fs", time.perf_counter() - t0)

    def _log_pool(self) -> None:
        cfg, c, pool = self.pool_config, self.config, self.pool
        mb = page_bytes(cfg, c.page_size, self.dtype) / 2**20
        log.info("unified pool: %d pages of %.2f MiB (%d KV tokens each); %d KV tokens if no adapter is resident",
                 pool.num_pages, mb, c.page_size, pool.num_pages * c.page_size)
        host = self.adapters.host
        log.info("host tier: at most %s adapters (max_cpu_loras) and %s (host_cache_fraction %.2f)",
                 host.capacity if host.capacity is not None else "any number of",
                 f"{host.max_bytes / 2**30:.1f} GiB" if host.max_bytes is not None else "no byte limit",
                 c.host_cache_fraction)
        for rank in sorted({8, 16, 64, c.max_lora_rank}):
            if rank <= c.max_lora_rank:
                log.info("  a rank-%d adapter on all 7 projections takes %d pages",
                         rank, adapter_pages(cfg, rank, c.page_size))

    # ------------------------------------------------------------- admission
    def validate(self, request: GenerationRequest) -> AdapterSpec | None:
        """Raise RequestError if the request cannot be served; returns the adapter version to use."""
        p, rid = request.sampling, request.request_id
        if self.tp is not None and self.tp.broken:
            raise RequestError(ErrorCode.UNAVAILABLE, f"request {rid}: {self.tp.broken.splitlines()[0]}; "
                                                      f"the engine must be restarted")
        check_request(request, self.model_config.vocab_size, self.max_len)
        n = len(request.prompt_ids)
        spec = None
        if request.adapter:
            try:
                spec = self.directory.resolve(request.adapter)
            except RequestError as e:
                raise RequestError(e.code, f"request {rid}: {e.message}") from None
        need = self.kv.pages_needed(n + p.max_tokens) + (self.adapters.pages(spec) if spec else 0)
        if need > self.pool.num_pages:
            raise RequestError(ErrorCode.INVALID_ARG,
                               f"request {rid}: {n + p.max_tokens} tokens and its adapter need {need} pages, more "
                               f"than the pool's {self.pool.num_pages} pages")
        limit = self.config.max_queue_size
        if limit and len(self.scheduler.waiting) + self._inbox.qsize() >= limit:
            raise RequestError(ErrorCode.UNAVAILABLE,
                               f"request {rid}: queue full ({limit} waiting requests, max_queue_size); retry later")
        return spec

    # ----------------------------------------------------- adapter lifecycle
    def load_adapter(self, name: str, path: str, sha256: str | None = None, replace: bool = False) -> dict:
        """Register (or, with replace, re-version) an adapter while serving (``AdapterDirectory.load``)."""
        return self.directory.load(name, path, sha256, replace)

    def unload_adapter(self, name: str) -> dict:
        """Unregister an adapter: new requests get NOT_FOUND, admitted ones finish on their version."""
        return self.directory.unload(name)

    def submit(self, request: GenerationRequest, emit: EmitFn) -> None:
        """Validate and queue a request; raises RequestError (nothing queued) if it is bad."""
        try:
            spec = self.validate(request)
        except RequestError as e:
            self.count_refusal(request.adapter, e.code)
            raise
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
        decoder = IncrementalDecoder(self.tokenizer, track_text=bool(request.sampling.stop))
        seq = Sequence(request, emit, decoder, make_generator(seed), self.eos_ids,
                       self.max_len, spec, self.config.stream_interval_ms / 1000)
        self._counters["requests"] += 1
        self.observer.request_arrived(seq.adapter)
        self._inbox.put(seq)
        self._wake.set()

    def count_refusal(self, adapter: str | None, code: ErrorCode) -> None:
        """Count a request refused before it reached the engine (the caller could not even parse it), so that
        ``stats()["errors"]`` and the observer's error count are one count. Thread-safe."""
        with self._refused_lock:
            self._refused += 1
        self.observer.request_failed(adapter or None, code.value)

    def cancel(self, request_id: str, why: str = "cancelled by the client") -> None:
        """Stop a queued or running request (from any thread): it ends with a CANCELLED error before the next
        step; an id that is not (or no longer) in the engine is ignored."""
        self._cancels.put((request_id, why))
        self._wake.set()

    # ---------------------------------------------------------------- queries
    def list_adapters(self) -> list[dict]:
        return self.directory.list()

    def stats(self) -> dict:
        """Counters and pool state; safe from any thread (taken between two loop iterations)."""
        with self._state_lock.reading():
            return self._stats()

    def _stats(self) -> dict:
        return {
            **self._counters,
            "errors": self._counters["errors"] + self._refused,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + self._inbox.qsize(),
            # requests per adapter name, for routers (the base model's are not listed): those in the running batch
            # and those queued (a request submitted since the last loop iteration is counted from the next)
            "running_adapters": _per_adapter(self.scheduler.running),
            "waiting_adapters": _per_adapter(self.scheduler.waiting),
            "max_loras": self.config.max_loras,
            "max_num_seqs": self.config.max_num_seqs,
            "page_size": self.kv.page_size,
            "preemptions": self.scheduler.num_preemptions,
            "adapters_registered": len(self.catalogue),
            "adapters_refused": len(self.catalogue.refused()),
            **self.adapters.stats(),
            "device": self.device,
            "dtype": str(self.dtype).replace("torch.", ""),
            "max_model_len": self.max_len,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "adapter_load_processes": self.load_processes,
        }

    def start(self) -> None:
        """Start the step loop (an engine made with start=False; a no-op once running)."""
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.adapters.host.shutdown()
        self.adapters.gpu.shutdown()
        if self.tp is not None:
            self.tp.shutdown()

    # ------------------------------------------------------------------- loop
    def _loop(self) -> None:
        if self.device.startswith("cuda") and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))  # the current device is per thread
        while not self._stopping.is_set():
            with self._state_lock.iteration():  # stats() reads the pool and the queues between iterations
                ran = self._iterate()
            if self._on_iteration is not None:
                try:
                    self._on_iteration()
                except Exception:  # noqa: BLE001 - the loop must go on; the hook's owner sees its own failure
                    log.error("on_iteration failed:\n%s", traceback.format_exc())
            if ran is None:  # nothing to do
                self._wake.wait(0.05)
                self._wake.clear()
            elif not ran:  # waiting only on adapter loads
                self._wake.wait(0.002)
                self._wake.clear()
        self._fail_all("the server is shutting down")
        if self._on_iteration is not None:
            with contextlib.suppress(Exception):
                self._on_iteration()

    def _iterate(self) -> bool | None:
        """One pass of the loop: admit what arrived, drop what was cancelled, run a step. None when
        there was no work; else whether a step ran."""
        self._drain_inbox()
        self._drop_cancelled()
        if not self.scheduler.has_work():
            return None
        self._pace_streams()
        try:
            self._prefetch()
            return self.step()
        except Exception:  # noqa: BLE001 - the engine must outlive any one bad step
            log.error("engine step failed:\n%s", traceback.format_exc())
            if self.tp is not None and self.tp.broken:  # no step can run again: fail what waits
                self._fail_all(self.tp.broken.splitlines()[0])
            return True

    def _pace_streams(self) -> None:
        """With stream_responses_per_s, each running stream's interval: (streams running) / that rate, never below
        stream_interval_ms (EngineConfig says why)."""
        rate = self.config.stream_responses_per_s
        if rate <= 0:
            return
        floor = self.config.stream_interval_ms / 1000
        streams = [seq for seq in self.scheduler.running if seq.request.stream]
        interval = max(floor, len(streams) / rate)
        if interval == floor == self._paced_interval_s:  # few streams: each has the floor since its submit
            return
        self._paced_interval_s = interval
        for seq in streams:
            seq.stream_interval_s = interval

    def _drain_inbox(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        """End what cancel() named; then, at most every CANCEL_POLL_S, poll the requests' cancellation flags and send
        the heartbeats that are due (GenerationRequest.keepalive_s)."""
        named = []
        while True:
            try:
                named.append(self._cancels.get_nowait())
            except queue.Empty:
                break
        if named:
            reasons = dict(named)
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                why = reasons.get(seq.request_id)
                if why is not None:
                    self._finish_with_error(seq, RequestError(ErrorCode.CANCELLED, f"request {seq.request_id}: {why}"))
        now = time.perf_counter()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            check = seq.request.is_cancelled
            try:
                cancelled = bool(check and check())
            except Exception:  # noqa: BLE001 - a broken sender counts as gone
                cancelled = True
            if cancelled:
                self._finish_with_error(seq, RequestError(ErrorCode.CANCELLED,
                                                          f"request {seq.request_id}: cancelled by the client"))
                continue
            keepalive = seq.request.keepalive_s
            if keepalive is not None and now - seq.last_output_at >= keepalive:
                self._emit(seq, GenerationOutput(request_id=seq.request_id, token_ids=[], context_ids=[],
                                                 heartbeat=True, adapter=seq.adapter,
                                                 adapter_sha256=seq.adapter_sha256))

    def _fail_all(self, why: str) -> None:
        self._drain_inbox()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish_with_error(seq, RequestError(ErrorCode.UNAVAILABLE, f"request {seq.request_id}: {why}"))

    def _prefetch(self) -> None:
        """Start host loads of queued requests' adapters; with async uploads, copy those already in host
        memory into free pages ahead of admission (never evicting, leaving a page per running sequence)."""
        pages = self.pool.pages
        upload_slots = self.config.max_num_seqs - len(self.scheduler.running)
        if not self.config.async_adapter_uploads:
            upload_slots = 0
        for i, seq in enumerate(self.scheduler.waiting):
            if i >= PREFETCH_LOOKAHEAD:
                break
            spec = seq.spec
            if not spec:
                continue
            self.adapters.prefetch(spec)
            if i >= upload_slots or self.adapters.gpu.get(spec) is not None or not self.adapters.host.contains(spec):
                continue
            spare = self.kv.pages_needed(seq.num_tokens() + 1) + len(self.scheduler.running)
            if pages.can_allocate(self.adapters.pages(spec) + spare):
                self.adapters.start_upload(spec)

    def step(self) -> bool:
        """One scheduling decision and one forward pass; False when nothing could run.

        A failure fails only the requests that cause it, before their state advances: if the batched forward
        raises, each sequence of the step runs again alone and only those that fail alone are failed; a request
        whose own sampling or output fails is failed alone; every other request advances as if nothing happened.
        """
        plan, failed = self.scheduler.schedule()
        for seq, error in failed:
            self._finish_with_error(seq, RequestError(ErrorCode.UNAVAILABLE, f"request {seq.request_id}: {error}"))
        if not plan:
            return bool(failed)
        gate = self.adapters.host.launch_gate
        try:
            if self._gate_loaders:
                gate.clear()  # adapter loaders wait while this step's kernels are launched
            lists, logits = self._forward(plan)
        except Exception:
            gate.set()
            if len(plan) == 1:
                self._fail_step(plan[0], traceback.format_exc())
            else:
                log.warning("a step of %d sequences failed; running each alone to find the cause:\n%s",
                            len(plan), traceback.format_exc())
                self._run_alone(plan)
            if self.tp is not None and self.tp.broken:  # no step can run again: fail what waits
                self._fail_all(self.tp.broken.splitlines()[0])
            return True
        gate.set()  # launched: loaders run while the device computes (sampling waits for it)
        self._counters["steps"] += 1
        self._advance(plan, lists.sampled, logits)
        return True

    def _forward(self, plan: list[ScheduledChunk]) -> tuple[StepLists, torch.Tensor]:
        """The step's forward: a decode CUDA graph, a mixed-step graph or the eager model; logits [sampled, V]."""
        build = self.steps
        lists = build.gather(plan)
        graph_inputs = None
        if self.graphs is not None and build.is_decode_only(plan) and self.graphs.fits(len(plan)):
            graph_inputs = build.graph_inputs(plan, lists)
        mixed = self.mixed_graphs
        if graph_inputs is not None and self.graphs.serves(graph_inputs.adapters):
            logits = self.graphs.run(graph_inputs)
        elif mixed is not None and mixed.fits(len(lists.ids), len(plan)) and build.pages_only(plan):
            logits = mixed.run(build.mixed_inputs(plan, lists))
        else:
            logits = self.model.forward(build.step_batch(plan, lists), self.kv, build.lora_batch(plan))
        return lists, logits

    def _run_alone(self, plan: list[ScheduledChunk]) -> None:
        """After a failed batched forward: each chunk's forward alone (eager; it rewrites the same KV slots). Those
        that fail alone are failed; the others advance."""
        for chunk in plan:
            try:
                lists = self.steps.gather([chunk])
                logits = self.model.forward(self.steps.step_batch([chunk], lists), self.kv,
                                            self.steps.lora_batch([chunk]))
            except Exception:  # noqa: BLE001 - this sequence's own step fails: it alone is failed
                self._fail_step(chunk, traceback.format_exc())
                continue
            self._advance([chunk], lists.sampled, logits)

    def _fail_step(self, chunk: ScheduledChunk, trace: str) -> None:
        seq = chunk.sequence
        log.error("request %s: step failed:\n%s", seq.request_id, trace)
        reason = trace.strip().splitlines()[-1][:300]
        self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL, f"request {seq.request_id}: step failed: "
                                                                      f"{reason}"))

    def _advance(self, plan: list[ScheduledChunk], sampled: list[Sequence], logits: torch.Tensor) -> None:
        """Commit a step: each chunk's tokens are computed, each sampled sequence gets its next token. A sequence
        whose sampling or output handling raises is failed alone (its state is dropped with it)."""
        row_of = {id(seq): row for row, seq in enumerate(sampled)}
        greedy = torch.argmax(logits, dim=-1).tolist() if sampled else []
        for chunk in plan:
            seq = chunk.sequence
            row = row_of.get(id(seq))
            if row is None:  # a prefill chunk that does not reach the end of the prompt: no token yet
                seq.num_computed += chunk.num_tokens
                self._counters["tokens_in"] += chunk.num_tokens
                continue
            params = seq.request.sampling
            try:
                token = greedy[row] if is_greedy(params) else sample_next(logits[row], params, seq.generator)
            except Exception as e:  # noqa: BLE001 - one request's sampling fails it alone
                log.warning("request %s: sampling failed: %s", seq.request_id, e)
                self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL,
                                                          f"request {seq.request_id}: sampling failed: {e}"))
                continue
            seq.num_computed += chunk.num_tokens
            self._counters["tokens_in"] += chunk.num_tokens
            try:
                self._take_token(seq, token)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error: this request alone
                log.warning("request %s: output failed:\n%s", seq.request_id, traceback.format_exc())
                self._finish_with_error(seq, RequestError(ErrorCode.INTERNAL,
                                                          f"request {seq.request_id}: output failed: {e}"))

    def _take_token(self, seq: Sequence, token: int) -> None:
        before = len(seq.output_ids)
        seq.append_token(token)
        self._counters["tokens_out"] += len(seq.output_ids) - before  # an EOS ends the request, it is no output
        self._observe_token(seq)
        output = seq.next_output()
        if output is not None:
            self._emit(seq, output)
        if seq.finish_reason is not None and seq.status is not Status.FINISHED:
            self.scheduler.remove(seq)
            self._counters["finished"] += 1
            self.observer.request_finished(seq.adapter, len(seq.prompt_ids), len(seq.output_ids),
                                           seq.finish_reason, seq.time_per_output_token())

    def _observe_token(self, seq: Sequence) -> None:
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
            queue_s = (seq.admitted_at or now) - seq.submitted_at
            self.observer.first_token(seq.adapter, queue_s, now - seq.submitted_at)
        seq.last_token_at = now

    def _emit(self, seq: Sequence, output: GenerationOutput) -> None:
        seq.last_output_at = time.perf_counter()
        try:
            seq.emit(output)
        except Exception:  # noqa: BLE001 - a client gone away must not stop the engine
            log.warning("request %s: emit failed:\n%s", seq.request_id, traceback.format_exc())
            if seq.status is not Status.FINISHED:
                seq.finish_reason = seq.finish_reason or "error"
                self.scheduler.remove(seq)
                self._counters["errors"] += 1
                self.observer.request_failed(seq.adapter, ErrorCode.UNAVAILABLE.value)

    def _finish_with_error(self, seq: Sequence, error: RequestError) -> None:
        if seq.status is Status.FINISHED:  # already ended (an emit that failed earlier in this pass)
            return
        self.scheduler.remove(seq)
        seq.finish_reason = "cancelled" if error.code is ErrorCode.CANCELLED else "error"
        self._counters["errors"] += 1
        self.observer.request_failed(seq.adapter, error.code.value)
        self._emit(seq, GenerationOutput(
            request_id=seq.request_id, token_ids=[], context_ids=[], finished=True,
            finish_reason=seq.finish_reason, error=error, adapter=seq.adapter, adapter_sha256=seq.adapter_sha256))

"""Tensor parallelism inside the engine: one engine (one Triton model instance) drives tp_size devices.

Rank 0 lives in the engine's process: the scheduler, the pool's bookkeeping and the sampler
stay there, and its shard of the model runs on the engine thread. Ranks 1..p-1 are worker
processes, each holding its shard of the base model (``manylora/engine/parallel/sharding.py``), a unified
pool with rank 0's page count and page layout, and its own host cache of adapter shards
(``manylora/engine/parallel/lora.py``: A whole and B split for q/k/v/gate/up; A split and B whole for o/down,
whose LoRA partial sums ride in the base all-reduce, so LoRA adds no communication).

Rank 0 sends each worker, in order, over one pipe:

* ``("prefetch", spec)``: start reading the adapter's shard into host memory;
* ``("place", spec, pages)``: copy the adapter's shard into these pages (rank 0 chose them);
* ``("step", batch, lora_state)``: run the forward pass over the same StepBatch and adapter
  tables; the two all-reduces per layer pair the ranks up;
* ``("stop",)``.

Workers decide nothing: page ids, adapter slots and offset tables come from rank 0. Every
rank has the same local shapes, so an adapter shard packs into the same pages at the same
offsets on every rank, and rank 0's tables are right everywhere. One ordered pipe per worker
means a worker has placed every adapter a step reads before it runs that step.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import functools
import logging
import os
import pickle
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.config import ModelKernelOptions
from manylora.engine.layers.comm import Comm
from manylora.engine.layers.lora_batch import LoraBatch
from manylora.engine.layers.step_batch import StepBatch
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.unified_pool import UnifiedPool
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.llama import LlamaModel
from manylora.engine.models.loader import DTYPES
from manylora.engine.parallel.lora import shard_lora_weights
from manylora.engine.parallel.sharding import check_tp, local_config, shard_tensor
from manylora.engine.processes import spawn_context

log = logging.getLogger("manylora.tp")

STARTUP_TIMEOUT_S = 600.0  # workers load their shards in this time or the engine refuses to start


@dataclass(frozen=True)
class TensorParallelSetup:
    """What every rank needs to build its part of the engine."""

    model_dir: str
    tp_size: int
    device: str  # rank 0's device: "cpu" (gloo), or "cuda[:k]" (NCCL; rank r on GPU k + r)
    dtype: str  # a key of manylora.engine.models.loader.DTYPES
    max_len: int
    page_size: int
    max_lora_rank: int
    max_cpu_loras: int | None
    kernels: ModelKernelOptions
    rehash_adapters: bool
    adapter_load_workers: int
    adapter_load_processes: int
    host_cache_bytes: int | None  # each rank's host tier limit
    init_file: str  # the process group's rendezvous (file://)
    collective_timeout_s: float = 120.0


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the CPU for every rank, or the rank-th GPU from rank 0's."""
    if not device.startswith("cuda"):
        return "cpu"
    first = torch.device(device).index or 0
    return f"cuda:{first + rank}"


def check_devices(device: str, tp_size: int) -> None:
    """Raise ValueError unless tp_size devices exist from ``device`` on."""
    if not device.startswith("cuda"):
        return
    first = torch.device(device).index or 0
    if first + tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {tp_size} from {device} needs GPUs {first}..{first + tp_size - 1}; "
                         f"torch sees {torch.cuda.device_count()}")


def load_rank_model(setup: TensorParallelSetup, cfg: ModelConfig, rank: int) -> LlamaModel:
    """Rank ``rank``'s shard of the base model (each checkpoint tensor cut as it is read)."""
    model = LlamaModel.load(setup.model_dir, local_config(cfg, setup.tp_size), setup.max_len,
                            rank_device(setup.device, rank), DTYPES[setup.dtype],
                            shard=lambda name, t: shard_tensor(name, t, cfg, rank, setup.tp_size))
    setup.kernels.apply_to(model)
    model.comm = Comm(rank=rank, size=setup.tp_size)
    return model


def rank_host_cache(setup: TensorParallelSetup, cfg: ModelConfig, rank: int, page_elems: int,
                    **kwargs) -> HostAdapterCache:
    """A host cache that keeps rank ``rank``'s shard of each adapter, packed for its pool."""
    return HostAdapterCache(cfg, DTYPES[setup.dtype], page_elems, setup.max_lora_rank, setup.max_cpu_loras,
                            pin_memory=False, workers=setup.adapter_load_workers, rehash=setup.rehash_adapters,
                            processes=setup.adapter_load_processes, max_bytes=setup.host_cache_bytes,
                            shard=functools.partial(shard_lora_weights, cfg=cfg, tp_rank=rank, tp_size=setup.tp_size),
                            pack_config=local_config(cfg, setup.tp_size), **kwargs)


def _init_group(setup: TensorParallelSetup, rank: int) -> None:
    import torch.distributed as dist

    backend = "nccl" if setup.device.startswith("cuda") else "gloo"
    if backend == "nccl":  # the lent H200 hosts require NVLink multicast (NVLS) left off
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(backend, init_method=f"file://{setup.init_file}", world_size=setup.tp_size, rank=rank,
                            timeout=timedelta(seconds=setup.collective_timeout_s))


# ------------------------------------------------------------------------------------------------ wire format
def _map_tensors(obj, fn):
    """obj with fn applied to every tensor inside (dataclasses, lists, tuples and dicts are rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _map_tensors(getattr(obj, f.name), fn))
        return out
    return obj


def lora_state(lora: LoraBatch | None) -> dict | None:
    """What a worker needs to rebuild a step's LoraBatch over its own pool (tables, slots, segments)."""
    if lora is None:
        return None
    state = {k: v for k, v in vars(lora).items() if k not in ("pool", "adapters")}
    state["num_adapters"] = len(lora.adapters)
    return state


def lora_from_state(state: dict | None, pool: torch.Tensor, device: str) -> LoraBatch | None:
    if state is None:
        return None
    batch = LoraBatch.__new__(LoraBatch)
    for key, value in state.items():
        if key == "num_adapters":
            continue
        # tables the torch path reads on the host stay there
        setattr(batch, key, value if key.endswith("_host") else _map_tensors(value, lambda t: t.to(device)))
    batch.adapters = [None] * state["num_adapters"]
    batch.pool = pool
    return batch


def _dumps(message: tuple) -> bytes:
    """Plain pickle with tensors copied to host memory (their bytes travel inline, not as shared memory)."""
    return pickle.dumps(_map_tensors(message, lambda t: t.detach().cpu()), protocol=pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------------------------------------------- workers
class _RankState:
    """A worker rank: its model shard, its pool (rank 0's page count and layout) and adapter shards."""

    def __init__(self, setup: TensorParallelSetup, cfg: ModelConfig, rank: int, num_pages: int) -> None:
        self.device = rank_device(setup.device, rank)
        self.model = load_rank_model(setup, cfg, rank)
        local = local_config(cfg, setup.tp_size)
        self.pool = UnifiedPool(local, num_pages, setup.page_size, DTYPES[setup.dtype], self.device)
        self.kv = PagedKVCache(self.pool)
        self.host = rank_host_cache(setup, cfg, rank, self.pool.page_elems)
        self.pages = self.pool.storage.view(num_pages, self.pool.page_elems)

    def prefetch(self, spec: AdapterSpec) -> None:
        self.host.request(spec)

    def place(self, spec: AdapterSpec, pages: list[int]) -> None:
        packed = self.host.wait(spec)
        if packed.num_pages != len(pages):
            raise RuntimeError(f"adapter '{spec.name}': this rank packs {packed.num_pages} pages, rank 0 placed "
                               f"{len(pages)}")
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.pages.index_copy_(0, index, packed.data.to(self.device))

    def step(self, batch: StepBatch, lora: dict | None) -> None:
        batch = _map_tensors(batch, lambda t: t.to(self.device))
        self.model.forward(batch, self.kv, lora_from_state(lora, self.pool.storage, self.device))


def worker_main(setup: TensorParallelSetup, cfg: ModelConfig, rank: int, conn) -> None:
    """A worker rank's process: build its state, then follow rank 0's messages until "stop"."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(name)s: %(message)s")
    if setup.device.startswith("cuda"):
        torch.cuda.set_device(rank_device(setup.device, rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.tp_size))
    state = None
    try:
        _init_group(setup, rank)
        kind, num_pages = pickle.loads(conn.recv_bytes())
        assert kind == "start", kind
        state = _RankState(setup, cfg, rank, num_pages)
        conn.send_bytes(pickle.dumps(("ready", None)))
        while True:
            message = pickle.loads(conn.recv_bytes())
            if message[0] == "stop":
                break
            getattr(state, message[0])(*message[1:])
    except EOFError:  # rank 0 went away
        pass
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails its requests
        text = traceback.format_exc()
        log.error("tensor-parallel rank %d failed:\n%s", rank, text)
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", text)))
    finally:
        if state is not None:
            state.host.shutdown()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------ rank 0
class TensorParallelGroup:
    """Rank 0's side: the worker processes, and the model the engine calls (``self.model``).

    Create it, compute the pool's page count on rank 0, then ``start(num_pages)``.
    """

    def __init__(self, setup: TensorParallelSetup, cfg: ModelConfig) -> None:
        import torch.distributed as dist

        check_tp(cfg, setup.tp_size)
        check_devices(setup.device, setup.tp_size)
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process (one per process)")
        self.setup = setup
        self.broken: str | None = None
        self._prefetched: set[tuple[str, str]] = set()
        ctx = spawn_context()
        self._conns = []
        self._procs = []
        for rank in range(1, setup.tp_size):
            parent, child = ctx.Pipe()
            # not daemonic: a rank starts adapter loader processes of its own (daemons may not have
            # children); it exits at "stop" or when rank 0's end of the pipe closes, and an exit
            # handler stops the ranks before multiprocessing joins them at interpreter exit
            proc = ctx.Process(target=worker_main, args=(setup, cfg, rank, child), name=f"manylora-tp{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        atexit.register(self.shutdown)
        _init_group(setup, 0)
        self.model = TensorParallelModel(load_rank_model(setup, cfg, 0), self)

    def start(self, num_pages: int) -> None:
        """Have every worker build its pool of num_pages pages; wait until all are ready."""
        for conn in self._conns:
            conn.send_bytes(_dumps(("start", num_pages)))
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"tensor-parallel rank {rank} not ready after {STARTUP_TIMEOUT_S:.0f}s")
            kind, detail = pickle.loads(conn.recv_bytes())
            if kind != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
        log.info("tensor parallelism: %d ranks ready on %s", self.setup.tp_size,
                 ", ".join(rank_device(self.setup.device, r) for r in range(self.setup.tp_size)))

    # the AdapterMirror protocol (manylora/engine/memory/adapter_manager.py)
    def prefetch(self, spec: AdapterSpec) -> None:
        """A hint: never raises (a broken group is reported by the next step)."""
        key = (spec.name, spec.sha256)
        if key not in self._prefetched and self.broken is None:
            self._prefetched.add(key)
            with contextlib.suppress(RuntimeError, OSError):
                self._send(("prefetch", spec))

    def place(self, spec: AdapterSpec, pages: list[int]) -> None:
        self._prefetched.discard((spec.name, spec.sha256))
        self._send(("place", spec, list(pages)))

    def send_step(self, batch: StepBatch, lora: LoraBatch | None) -> None:
        self._send(("step", batch, lora_state(lora)))

    def _send(self, message: tuple) -> None:
        self.check()
        data = _dumps(message)
        for conn in self._conns:
            try:
                conn.send_bytes(data)
            except OSError:  # the rank went away since check()
                self.check()
                raise

    def check(self) -> None:
        """Raise if a worker failed or exited (the group cannot run another step then)."""
        if self.broken is None:
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
                try:
                    if conn.poll():  # an error report, or the end of the pipe of a rank that is gone
                        kind, detail = pickle.loads(conn.recv_bytes())
                        self.broken = f"tensor-parallel rank {rank} reported {kind}:\n{detail}"
                except (EOFError, OSError):
                    pass
                if self.broken is None and not proc.is_alive():
                    proc.join(1)
                    self.broken = f"tensor-parallel rank {rank} exited (code {proc.exitcode})"
                if self.broken:
                    log.error("%s", self.broken)
                    break
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def shutdown(self, timeout: float = 10.0) -> None:
        import torch.distributed as dist

        atexit.unregister(self.shutdown)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("stop",)))
        for proc in self._procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(Path(self.setup.init_file).parent, ignore_errors=True)


def new_init_file() -> str:
    """A fresh path for the process group's file rendezvous (the file must not exist yet)."""
    return str(Path(tempfile.mkdtemp(prefix="manylora-tp-")) / "rendezvous")


class TensorParallelModel:
    """What the engine calls as its model: sends the step to the workers, then runs rank 0's shard."""

    def __init__(self, rank0: LlamaModel, group: TensorParallelGroup) -> None:
        self.rank0 = rank0
        self.group = group

    def weight_bytes(self) -> int:
        return self.rank0.weight_bytes()

    def forward(self, batch: StepBatch, kv: PagedKVCache, lora: LoraBatch | None) -> torch.Tensor:
        self.group.send_step(batch, lora)
        return self.rank0.forward(batch, kv, lora)

"""Adapter loading in child processes: reading, checking and packing off the engine's GIL.

A loader thread in the engine's process holds the GIL whenever it runs Python, and every
Triton kernel launch of the engine thread releases the GIL and must win it back: with loaders
busy, eager steps of a few hundred launches took seconds on the H200 (manylora/engine/adapters/host_cache.py
then gates the loaders while a step is launched, which in turn stalls loading). A loader
*process* has its own interpreter: loading scales with processes and leaves the engine alone.

The child packs the adapter straight into a file in shared memory (``/dev/shm``, or the temp
directory when that has no room) and returns its path and the small offset tables; the
engine's process maps the file (copy-on-write, no copy), unlinks it and holds the mapping as
the packed adapter's ``data``: the 84 MB of a rank-16 Llama-3-8B adapter are never pickled or
copied between processes. The engine's thread only waits on a future, which releases the GIL.

Stopping: ``shutdown`` cancels the queued loads and waits (at most STOP_TIMEOUT_S, then kills the
children) until the children have finished the loads they hold and exited. It must wait: a spawned
process (the engine's, a tensor-parallel rank) ends by running its multiprocessing finalizers, which
close the pool's queue to the children, and only then joins the children; a pool left to stop by
itself loses its stop messages to the closed queue, and the exit waits on the children for ever. A
child whose parent died without stopping it (killed) removes its files no one mapped and exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from manylora.engine.adapters.packing import PackedAdapter, pack_adapter
from manylora.engine.adapters.spec import AdapterSpec, LoraWeights
from manylora.engine.adapters.weights import load_adapter_weights
from manylora.engine.errors import AdapterError
from manylora.engine.model_config import ModelConfig
from manylora.engine.processes import spawn_context

LOAD_TIMEOUT_S = 300.0  # a load by a child that takes longer is given up: the pool is replaced, the adapter loaded here
STOP_TIMEOUT_S = 10.0  # at shutdown, the children's loads in hand finish within this, else the children are killed
log = logging.getLogger("manylora.adapter_process_loader")

SHM_DIR = "/dev/shm"
FILE_PREFIX = "manylora-adapter-"  # a child's packed file: FILE_PREFIX + its pid + "-" + a random hex
SHM_MIN_FREE_BYTES = 4 << 30  # below this much free shared memory, pack into the temp directory


@dataclass(frozen=True)
class PackJob:
    """What a child needs to load and pack one adapter (all picklable)."""

    spec: AdapterSpec
    model_config: ModelConfig  # adapters are checked against it
    pack_config: ModelConfig  # the pool's shapes (a tensor-parallel rank's local ones)
    dtype: torch.dtype
    page_elems: int
    max_rank: int
    rehash: bool
    directory: str
    shard: Callable[[LoraWeights], LoraWeights] | None = None  # a tensor-parallel rank's part


@dataclass(frozen=True)
class PackedFile:
    """A child's answer: the pages in ``path`` (numel elements of dtype), the tables as arrays."""

    path: str
    numel: int
    dtype: torch.dtype
    num_pages: int
    row_offsets: np.ndarray
    ranks: np.ndarray
    scalings: np.ndarray


def choose_directory() -> str:
    """/dev/shm when it exists with room to spare, else the temp directory (a disk: slower, works)."""
    try:
        if os.access(SHM_DIR, os.W_OK) and shutil.disk_usage(SHM_DIR).free >= SHM_MIN_FREE_BYTES:
            return SHM_DIR
    except OSError:
        pass
    return tempfile.gettempdir()


def _child_init(directory: str) -> None:
    torch.set_num_threads(1)  # packing is copies; one thread per process, the processes in parallel
    threading.Thread(target=_exit_with_parent, args=(directory,), name="manylora-loader-parent-watch",
                     daemon=True).start()


def _exit_with_parent(directory: str) -> None:
    """In a child: once the parent is gone (killed, so it never stopped the pool), remove this child's files
    (the one being filled, the packed ones the parent never mapped: it unlinks each as it maps it) and exit; the
    pool's queue would otherwise keep this process waiting for ever."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    parent.join()  # returns when the parent's end of the start pipe closes: it exited
    remove_files_of(directory, os.getpid())
    os._exit(1)


def remove_files_of(directory: str, pid: int) -> None:
    """Remove the packed files loader child ``pid`` made in ``directory`` and no one mapped."""
    for left in Path(directory).glob(f"{FILE_PREFIX}{pid}-*"):
        left.unlink(missing_ok=True)


def _ready() -> bool:
    return True


def load_and_pack(job: PackJob) -> PackedFile | tuple[str, str]:
    """In a child: the adapter packed into a new file of job.directory; ("error", reason) if it cannot
    be served (an exception would have to survive pickling); ("no room", why) if the file could not
    be made (the caller loads the adapter itself)."""
    path = Path(job.directory) / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"

    def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = max(1, numel * torch.tensor([], dtype=dtype).element_size())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # no room: an OSError here, not a SIGBUS while writing
        finally:
            os.close(fd)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    try:
        packed = pack_adapter(_weights(job), job.pack_config, job.page_elems, job.max_rank, allocate=allocate)
    except OSError as e:  # the shared-memory file could not be made or filled (no room left there)
        path.unlink(missing_ok=True)
        return ("no room", f"{job.directory}: {e}")
    except AdapterError as e:
        path.unlink(missing_ok=True)
        return ("error", e.reason)
    except Exception as e:  # noqa: BLE001 - any failure is this adapter's
        path.unlink(missing_ok=True)
        return ("error", f"failed to load: {type(e).__name__}: {e}")
    return PackedFile(str(path), packed.data.numel(), packed.data.dtype, packed.num_pages,
                      packed.row_offsets.numpy(), packed.ranks.numpy(), packed.scalings.numpy())


def adopt(spec: AdapterSpec, answer: PackedFile, page_elems: int) -> PackedAdapter:
    """In the engine's process: map the child's file as the adapter's pages, and unlink it."""
    try:
        data = torch.from_file(answer.path, shared=False, size=answer.numel, dtype=answer.dtype)
    finally:
        Path(answer.path).unlink(missing_ok=True)
    return PackedAdapter(spec, data.view(answer.num_pages, page_elems), torch.from_numpy(answer.row_offsets),
                         torch.from_numpy(answer.ranks), torch.from_numpy(answer.scalings))


class ProcessLoader:
    """A pool of loader processes; ``load`` blocks its (host-cache worker) thread without the GIL."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.directory = choose_directory()
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        log.info("%d adapter loader processes, packing into %s", processes, self.directory)

    def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.processes, mp_context=spawn_context(), initializer=_child_init,
                                   initargs=(self.directory,))
        # start the interpreters now, not at the first adapter (each imports torch: seconds)
        self._started = [pool.submit(_ready) for _ in range(self.processes)]
        return pool

    def wait_started(self, timeout: float | None = None) -> None:
        """Block until the children have started (for benchmarks and tools)."""
        for future in self._started:
            future.result(timeout)

    def load(self, spec: AdapterSpec, model_config: ModelConfig, pack_config: ModelConfig, dtype: torch.dtype,
             page_elems: int, max_rank: int, rehash: bool,
             shard: Callable[[LoraWeights], LoraWeights] | None = None) -> PackedAdapter:
        """Raises AdapterError if the adapter cannot be served. If the pool broke (a child was killed),
        it is replaced and this adapter loaded in this process instead."""
        job = PackJob(spec, model_config, pack_config, dtype, page_elems, max_rank, rehash, self.directory, shard)
        with self._lock:
            pool = self._pool
        try:
            if not _all_alive(pool):  # a dead child: the pool's own thread may not have noticed yet
                raise BrokenProcessPool("a loader process is dead")
            answer = pool.submit(load_and_pack, job).result(timeout=LOAD_TIMEOUT_S)
        except (BrokenProcessPool, TimeoutError) as e:
            log.warning("adapter loader processes failed (%s); restarting them, loading '%s' in-process",
                        type(e).__name__, spec.name)
            with self._lock:
                if self._pool is pool:
                    children = _children(pool)  # before the shutdown, which forgets them
                    pool.shutdown(wait=False, cancel_futures=True)
                    self._kill_children(children)  # one may hang (the timeout): the exit would wait on it
                    self._pool = self._new_pool()
            return _load_here(job)
        if isinstance(answer, tuple) and answer[0] == "no room":
            log.warning("adapter '%s': cannot pack into shared memory (%s); loading it in-process", spec.name,
                        answer[1])
            return _load_here(job)
        if isinstance(answer, tuple):
            raise AdapterError(spec.name, answer[1])
        return adopt(spec, answer, page_elems)

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel the queued loads; wait until the children finished the ones in hand and exited (module
        docstring: returning earlier can leave this process's exit waiting on them for ever). Past ``timeout``
        the children are killed and the files they were filling removed."""
        with self._lock:
            pool = self._pool
        children = _children(pool)
        stopper = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                   name="manylora-loader-stop", daemon=True)
        stopper.start()
        stopper.join(timeout)
        if not stopper.is_alive():
            return
        log.warning("adapter loader processes did not stop within %.0f s of the shutdown; killing them", timeout)
        self._kill_children(children)
        stopper.join(5)

    def _kill_children(self, children: list) -> None:
        """Kill a pool's children and remove the files they made that no one mapped."""
        for child in children:
            if child.is_alive():
                child.kill()
        for child in children:
            child.join(5)
            remove_files_of(self.directory, child.pid)


def _children(pool: ProcessPoolExecutor) -> list:
    """The pool's processes (none once it was shut down)."""
    return list((getattr(pool, "_processes", None) or {}).values())


def _all_alive(pool: ProcessPoolExecutor) -> bool:
    return all(process.is_alive() for process in _children(pool))


def _weights(job: PackJob) -> LoraWeights:
    weights = load_adapter_weights(job.spec, job.model_config, dtype=job.dtype, rehash=job.rehash)
    return job.shard(weights) if job.shard is not None else weights


def _load_here(job: PackJob) -> PackedAdapter:
    return pack_adapter(_weights(job), job.pack_config, job.page_elems, job.max_rank)

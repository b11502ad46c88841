"""How fast the host tier turns adapter files into packed pool pages (CPU work; no GPU needed).

    python -m perf.engine.bench_adapter_load --shape llama3-8b --adapters 16 --workers 1 2 4 --processes 1 2 4

Writes ``--adapters`` distinct random rank-16 adapters on all 7 projections of the shape, then
(1) times the phases of one load (sha256, the whole load with hashing, pack), median of the
adapters; (2) loads all of them through HostAdapterCache with each worker count, re-hashing every
file and trusting unchanged files (the default), and reports adapters/s and MB/s. The page cache
is warm in (2) (the files were just written or read), as for adapters on a local disk that were
used before; (3) the same with loader processes (``adapter_load_processes``); (4) a stand-in for the
engine loop (a step's launches as many short torch calls, then device time as a sleep) while one
loader thread (gated as the engine gates it, or not) or one loader process loads every adapter:
how much longer the launches take, and how fast loading goes meanwhile.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from manylora.engine.adapters.host_cache import HostAdapterCache
from manylora.engine.adapters.packing import pack_adapter
from manylora.engine.adapters.spec import STAMP_MIN_AGE_S, parse_adapter_spec
from manylora.engine.adapters.weights import load_adapter_weights, map_file
from manylora.engine.memory.unified_pool import page_bytes
from manylora.engine.model_config import ModelConfig
from perf.engine.checkpoint import SHAPES, write_adapter, write_config


def phase_times(spec, cfg: ModelConfig, page_elems: int) -> dict[str, float]:
    """Seconds of one load's parts: hashing the mapped file, load_adapter_weights (map, hash, parse,
    checks), pack_adapter."""
    data, _ = map_file(spec.weights_path)
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    t1 = time.perf_counter()
    weights = load_adapter_weights(spec, cfg, dtype=torch.bfloat16, rehash=True)
    t2 = time.perf_counter()
    pack_adapter(weights, cfg, page_elems, 16)
    t3 = time.perf_counter()
    return {"sha256": t1 - t0, "load (hash incl.)": t2 - t1, "pack": t3 - t2, "total": t3 - t1}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--launches", type=int, default=600, help="small torch ops per simulated step launch")
    p.add_argument("--device-ms", type=float, default=15.0, help="simulated device time per step")
    a = p.parse_args(argv)
    shape = SHAPES[a.shape]
    with tempfile.TemporaryDirectory(prefix="manylora-load-") as tmp:
        root = Path(tmp)
        base = write_config(root / "base", shape)
        cfg = ModelConfig.from_dir(base)
        page_elems = page_bytes(cfg, 16, torch.bfloat16) // 2
        paths = [write_adapter(root / f"a{i}", shape, rank=16, seed=i, base_dir=str(base)) for i in range(a.adapters)]
        time.sleep(STAMP_MIN_AGE_S + 0.1)  # as adapters written before the server starts: stamps are trusted
        specs = [parse_adapter_spec(f"a{i}", path, cfg, 16) for i, path in enumerate(paths)]
        mb = specs[0].weights_path.stat().st_size / 1e6
        print(f"{a.shape}: {a.adapters} adapters of {mb:.1f} MB (rank 16, 7 projections, bf16); "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
        phases = [phase_times(s, cfg, page_elems) for s in specs]
        print("one load, median ms: " + ", ".join(
            f"{k} {1e3 * statistics.median(ph[k] for ph in phases):.1f}" for k in phases[0]))
        for workers, rehash in [(w, r) for r in (True, False) for w in a.workers]:
            wall = load_all(HostAdapterCache(cfg, torch.bfloat16, page_elems, 16, capacity=None, pin_memory=False,
                                             workers=workers, rehash=rehash), specs)
            how = "re-hashing every file" if rehash else "files unchanged since registration"
            print(f"{how}, threads {workers}: {a.adapters} loads in {wall:.2f} s = {a.adapters / wall:.1f} "
                  f"adapters/s, {a.adapters * mb / wall:.0f} MB/s")
        for processes in a.processes:
            cache = HostAdapterCache(cfg, torch.bfloat16, page_elems, 16, capacity=None, pin_memory=False,
                                     workers=processes, processes=processes)
            cache.wait_started(120)  # interpreter start-up is paid once, at engine start
            wall = load_all(cache, specs)
            print(f"files unchanged since registration, processes {processes}: {a.adapters} loads in {wall:.2f} s = "
                  f"{a.adapters / wall:.1f} adapters/s, {a.adapters * mb / wall:.0f} MB/s")
        print(f"\nengine loop stand-in: {a.launches} small torch ops per step ('launch'), then {a.device_ms} ms "
              f"of 'device time' (sleep, GIL free), while one loader loads all {a.adapters} adapters:")
        rows = [("no loader", *engine_loop(None, specs, a))]
        for mode in ("thread, gated", "thread, no gate", "process"):
            cache = HostAdapterCache(cfg, torch.bfloat16, page_elems, 16, capacity=None, pin_memory=False, workers=1,
                                     processes=1 if mode == "process" else 0)
            rows.append((mode, *engine_loop(cache, specs, a, gate=mode == "thread, gated")))
        print("| loader | launch ms, median | launch ms, p90 | loads/s during the loop |")
        print("|---|---|---|---|")
        for mode, p50, p90, rate in rows:
            print(f"| {mode} | {p50:.2f} | {p90:.2f} | {rate} |")


def load_all(cache: HostAdapterCache, specs) -> float:
    """Seconds to load every spec through the cache (all requested at once), then shut it down."""
    t = time.perf_counter()
    for s in specs:
        cache.request(s)
    for s in specs:
        cache.wait(s, timeout=600)
    wall = time.perf_counter() - t
    cache.shutdown()
    return wall


def engine_loop(cache: HostAdapterCache | None, specs, a, gate: bool = False) -> tuple[float, float, str]:
    """The engine's pattern: launch a step (many short Python->C++ calls), let the device compute.
    Returns median and p90 ms of the launch phase, and the loads/s the loader reached meanwhile."""
    x = torch.zeros(16)
    if cache is not None:
        cache.wait_started(120)
        t0 = time.perf_counter()
        for s in specs:
            cache.request(s)
    launches = []
    steps = 0
    while (cache is not None and cache.stats()["host_loads"] < len(specs)) or (cache is None and steps < 50):
        if cache is not None and gate:
            cache.launch_gate.clear()
        t = time.perf_counter()
        for _ in range(a.launches):
            x.add_(1.0)
        launches.append(1e3 * (time.perf_counter() - t))
        if cache is not None:
            cache.launch_gate.set()
        time.sleep(a.device_ms / 1e3)
        steps += 1
    rate = "-"
    if cache is not None:
        rate = f"{len(specs) / (time.perf_counter() - t0):.1f}"
        cache.shutdown()
    launches.sort()
    return statistics.median(launches), launches[int(0.9 * (len(launches) - 1))], rate

if __name__ == "__main__":
    main()

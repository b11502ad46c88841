"""How fast the host tier turns adapter files into packed pool pages (CPU work; no GPU needed).

    python -m perf.bench_adapter_load --shape llama3-8b --adapters 16 --workers 1 2 4

Writes ``--adapters`` distinct random rank-16 adapters on all 7 projections of the shape, then
(1) times the phases of one load (sha256, the whole load with hashing, pack), median of the
adapters; (2) loads all of them through HostAdapterCache with each worker count, re-hashing every
file and trusting unchanged files (the default), and reports adapters/s and MB/s. The page cache
is warm in (2) (the files were just written or read), as for adapters on a local disk that were
used before.
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

from backend.adapter import STAMP_MIN_AGE_S, _map_file, load_adapter_weights, parse_adapter_spec
from backend.adapter_packing import pack_adapter
from backend.host_cache import HostAdapterCache
from backend.model_config import ModelConfig
from backend.unified_pool import page_bytes
from perf.checkpoint import SHAPES, write_adapter, write_config


def phase_times(spec, cfg: ModelConfig, page_elems: int) -> dict[str, float]:
    """Seconds of one load's parts: hashing the mapped file, load_adapter_weights (map, hash, parse,
    checks), pack_adapter."""
    data, _ = _map_file(spec.weights_path)
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
            cache = HostAdapterCache(cfg, torch.bfloat16, page_elems, 16, capacity=None, pin_memory=False,
                                     workers=workers, rehash=rehash)
            t = time.perf_counter()
            for s in specs:
                cache.request(s)
            for s in specs:
                cache.wait(s, timeout=600)
            wall = time.perf_counter() - t
            cache.shutdown()
            how = "re-hashing every file" if rehash else "files unchanged since registration"
            print(f"{how}, workers {workers}: {a.adapters} loads in {wall:.2f} s = {a.adapters / wall:.1f} adapters/s, "
                  f"{a.adapters * mb / wall:.0f} MB/s")


if __name__ == "__main__":
    main()

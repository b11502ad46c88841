"""Tensor parallelism on real GPUs: the engine at tp=2 (NCCL, cuda:0 and cuda:1) against tp=1 on a small
random Llama with four adapters, greedy, float32; prints whether every request's tokens agree.

    PYTHONPATH=tests python3 -m perf.engine.tp_smoke      # on a machine with 2+ GPUs
    PYTHONPATH=tests python3 -m perf.engine.tp_smoke cpu  # gloo on the CPU
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from manylora.engine.config import EngineConfig
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.offline import generate
from model_factory import make_base, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": the same with gloo (a smoke test here)
    root = Path(tempfile.mkdtemp(prefix="tp-smoke-"))
    base = make_base(root / "base", "llama", seed=23, hidden=256, heads=8, kv_heads=4, intermediate=512, layers=4)
    adapters = {f"a{i}": str(write_random_adapter(root / f"a{i}", base, rank=r, targets=ALL, seed=i))
                for i, r in enumerate([2, 4, 8, 16])}
    rng = random.Random(0)
    names = [None, *adapters]
    cases = [([1] + [rng.randrange(3, 250) for _ in range(rng.randint(4, 40))], names[i % 5]) for i in range(20)]
    outputs = {}
    for tp in (1, 2):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                     tensor_parallel_size=tp, max_lora_rank=16, max_num_seqs=8, num_kv_pages=512,
                                     cuda_graphs=False, kernels="torch", warmup=False))  # no JIT: a quick check
        started = time.perf_counter() - t0
        try:
            reqs = [GenerationRequest(f"r{i}", p, a, SamplingParams(max_tokens=16)) for i, (p, a) in enumerate(cases)]
            t1 = time.perf_counter()
            results = generate(engine, reqs, timeout=120)
            errors = [r.error for r in results if r.error]
            outputs[tp] = [r.token_ids for r in results]
            print(f"tp={tp}: started in {started:.1f}s, 20 requests in {time.perf_counter() - t1:.1f}s, "
                  f"errors {errors[:2]}", flush=True)
        finally:
            engine.shutdown()
    same = sum(a == b for a, b in zip(outputs[1], outputs[2], strict=True))
    print(f"tp=2 equals tp=1 on {same}/20 requests (token for token)")
    return 0 if same == 20 else 1


if __name__ == "__main__":
    sys.exit(main())

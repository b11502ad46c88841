"""The engine thread's host time per decode step at many running sequences, without the model's forward.

    python -m perf.engine.bench_host_step --seqs 256 --steps 200 [--profile]

Nothing here waits for a GPU: the forward is replaced by fixed logits, so what is timed is what the engine thread
does around it (scheduling, gathering the step's tokens and pages, filling a decode graph's input buffers with
``DecodeGraphs.load``, sampling and handing out tokens). On a GPU the step loop does this while the device waits,
step after step, so each millisecond here is a millisecond of every step. The tiny random model and the CPU keep it
runnable anywhere; prompts of 100-500 tokens in 16-token pages give block tables as wide as the capacity
benchmark's. ``--profile`` prints the functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch


def measure(seqs: int, steps: int, profile: bool = False, seed: int = 0) -> float:
    """Mean host milliseconds of a decode step at ``seqs`` running sequences (after 5 unmeasured steps)."""
    from manylora.engine.config import EngineConfig
    from manylora.engine.execution.cuda_graphs import DecodeGraphs
    from manylora.engine.memory.unified_pool import ReservedPage
    from manylora.engine.requests.types import GenerationRequest, SamplingParams
    from manylora.engine.scheduling.engine import Engine
    from perf.engine.checkpoint import SHAPES, write_base

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="manylora-host-step-") as tmp:
        base = write_base(Path(tmp) / "base", SHAPES["tiny"], dtype=torch.float32)
        engine = Engine(EngineConfig(model_dir=str(base), device="cpu", dtype="float32", max_num_seqs=seqs,
                                     max_num_batched_tokens=600 * seqs, page_size=16, warmup=False,
                                     max_model_len=1032), start=False)
        try:
            for i in range(seqs):
                prompt = [rng.randrange(2, 200) for _ in range(rng.randint(100, 500))]
                engine.submit(GenerationRequest(f"r{i}", prompt, None, SamplingParams(max_tokens=500, ignore_eos=True),
                                                stream=True), lambda out: None)
            engine._drain_inbox()
            engine.step()  # every prompt in one eager step
            scratch = engine.pool.pages.allocate(ReservedPage("decode-graph padding"), 1)[0]
            graphs = DecodeGraphs(engine.model, engine.kv, scratch, seqs, engine.kv.pages_needed(engine.max_len), 8,
                                  16)
            logits = torch.randn(seqs, engine.model.lm_head.shape[0])

            def forward(plan):  # the engine's decode path, up to the replay
                lists = engine.steps.gather(plan)
                graphs.load(engine.steps.graph_inputs(plan, lists))
                return lists, logits[: len(lists.sampled)]

            engine._forward = forward
            for _ in range(5):
                engine.step()
            assert len(engine.scheduler.running) == seqs, "every sequence must still be decoding"
            profiler = cProfile.Profile() if profile else None
            if profiler:
                profiler.enable()
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            elapsed = time.perf_counter() - t
            if profiler:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        finally:
            engine.shutdown()
    return elapsed / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="at most 490 (the requests' 500 tokens)")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args(argv)
    if not 0 < a.steps <= 490:
        p.error("--steps must be in 1..490")
    print(f"host time per decode step at {a.seqs} sequences: {measure(a.seqs, a.steps, a.profile):.3f} ms")


if __name__ == "__main__":
    main()

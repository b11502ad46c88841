"""The decode graphs' step (manylora/engine/execution/cuda_graphs.py) run eagerly on the CPU:
``DecodeGraphs.run_eager`` is the forward
a graph captures, over the same padded buffers and adapter tables, with no graph, under the Triton interpreter.

It covers what the CPU never reaches otherwise: the graphs' buffer filling, and for ``decode_lora_kernels`` "sgmv" and
"hybrid" the grouping of tokens by adapter on the device at every step (``build_segments_on_device``), which only a
graph-mode batch uses. A GPU runs the real graphs instead (test_engine_kernels.py).
"""

from __future__ import annotations

import random

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.execution.cuda_graphs import DecodeGraphs
from manylora.engine.memory.unified_pool import ReservedPage
from manylora.engine.scheduling.engine import Engine
from model_factory import assert_generations_match_peft, assert_pool_drained, make_base, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("decode_lora", ["bgmv", "sgmv", "hybrid"])
def test_decode_graph_step_matches_peft(tmp_path, device, decode_lora):
    """Requests of four adapters (ranks 1-16, some projections each) and base-only ones: their decode steps go through
    the graphs' padded buffers (bucket 8 for 5-7 sequences, 4 for 3), with the adapters' tables filled into 8 slots."""
    if device != "cpu":
        pytest.skip("a GPU replays the real graphs (test_engine_kernels.py)")
    base = make_base(tmp_path / "base", "llama", seed=31)
    rng = random.Random(decode_lora)
    adapters = {f"a{i}": str(write_random_adapter(tmp_path / f"a{i}", base, rank=rank,
                                                  targets=rng.sample(ALL, rng.randint(1, 7)), seed=40 + i))
                for i, rank in enumerate([1, 4, 8, 16])}
    engine = Engine(EngineConfig(model_dir=str(base), adapters=adapters, device=device, dtype="float32",
                                 kernels="triton", max_lora_rank=16, page_size=8, max_num_seqs=8, max_loras=8,
                                 decode_lora_kernels=decode_lora, warmup=False), start=False)
    try:
        scratch = engine.pool.pages.allocate(ReservedPage("cuda-graph padding"), 1)[0]
        graphs = DecodeGraphs(engine.model, engine.kv, scratch, 8, engine.kv.pages_needed(engine.max_len), 8, 16,
                              decode_form=decode_lora)
        steps: list[tuple[int, int]] = []  # (sequences, adapters) of each step through the graphs' buffers
        run_eager = graphs.run_eager

        def run(inputs):
            steps.append((inputs.input_ids.numel(), len(inputs.adapters)))
            return run_eager(inputs)

        graphs.run = run
        engine.graphs = graphs
        engine.start()
        names = [None, *adapters]
        cases = [([0] + [rng.randrange(2, 290) for _ in range(rng.randint(1, 12))], names[i % len(names)])
                 for i in range(7)]
        assert_generations_match_peft(engine, base, adapters, cases, 6, "d")
        assert sum(1 for _, n in steps if n >= 3) >= 3, steps  # decode steps of several adapters went through them
        assert_pool_drained(engine)
    finally:
        engine.shutdown()

"""The MoE LoRA batch in CUDA-graph mode (``LoraBatch.from_tables(..., graph_experts=True)``: every layer's experts
through the fused kernel, nothing decided on the host), run eagerly on a tiny Qwen3-MoE shape under the
interpreter: the same logits as the batch the engine builds for eager steps, including layers and tokens whose
adapter leaves the experts alone; and the host check that keeps inexpressible adapters out of the graphs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from manylora.engine.adapters.packing import _layout
from manylora.engine.layers.lora_batch import LoraBatch, moe_lora_expressible
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.sizing import synthetic_spec
from manylora.engine.memory.unified_pool import UnifiedPool, page_elements
from perf.engine.bench_moe_step import SHAPES, decode_batch, random_model, synthetic_adapters, write_config


def test_graph_mode_batch_matches_eager_batch(device):
    s = SHAPES["tiny"]
    torch.manual_seed(5)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_config(Path(tmp), s)
    model = random_model(cfg, s, device, torch.float32, max_len=24)
    adapter_pages = _layout(synthetic_spec(cfg, 4), cfg, page_elements(cfg, 8))[0]
    pool = UnifiedPool(cfg, 5 * 3 + 3 * adapter_pages + 1, 8, torch.float32, device)
    kv = PagedKVCache(pool)
    residents = synthetic_adapters(pool, 3, 4, device)
    # adapter 2 keeps its attention LoRA but has none on the experts of layer 0
    residents[2].ranks[0, 7:] = 0
    tables = [pool.pages.allocate(f"seq{b}", 3) for b in range(5)]
    for page in (p for t in tables for p in t):
        pool.storage[page * pool.page_elems:(page + 1) * pool.page_elems].normal_()
    step = decode_batch(kv, tables, 20, s.vocab, device)
    eager = LoraBatch([0, 1, 2, -1, 1], residents, pool.storage, device, use_kernels=True)
    graph = LoraBatch.from_tables(eager.token_slots, eager.row_offsets, eager.ranks, eager.scalings, pool.storage,
                                  graph_experts=True)
    assert graph.has_static_expert_path() and not eager.has_static_expert_path()
    want = model.forward(step, kv, eager)
    got = model.forward(step, kv, graph)
    base = model.forward(step, kv, None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - base).abs().max() > 1e-2, "the adapters change the logits"
    # a CUDA-graph replay refills the same tables in place and runs the same batch object again: what the batch
    # derives from them (the MoE kernel's tables) must follow, not stay as they were at its first forward
    moved = LoraBatch([2, -1, 0, 1, 0], residents, pool.storage, device, use_kernels=True)
    graph.token_slots.copy_(moved.token_slots)
    torch.testing.assert_close(model.forward(step, kv, graph), model.forward(step, kv, moved), rtol=1e-4, atol=1e-4)


def test_moe_lora_expressible():
    experts = 4
    ranks = torch.full((2 * experts, 3), 8, dtype=torch.int32)
    scalings = torch.full((2 * experts, 3), 2.0)
    assert moe_lora_expressible(ranks, scalings)
    ranks[:, 1] = 0  # an adapter without expert LoRA
    assert moe_lora_expressible(ranks, scalings)
    gate_up_2r = ranks.clone()
    gate_up_2r[0::2, 2] = 16  # PEFT's renamed transformers-4 targets: gate_up rank 2r, down r
    assert not moe_lora_expressible(gate_up_2r, scalings)
    uneven = ranks.clone()
    uneven[4, 0] = 4  # expert 2's gate_up of adapter 0 differs from expert 0's
    assert not moe_lora_expressible(uneven, scalings)
    other_scale = scalings.clone()
    other_scale[1::2, 0] = 1.0  # down scaled differently from gate_up
    assert not moe_lora_expressible(ranks, other_scale)


def test_decode_graphs_serve_only_expressible_adapters():
    """DecodeGraphs.serves on an MoE base: a batch goes to the graph only when the fused kernel expresses every one
    of its adapters in every layer (checked once per adapter); a dense base serves everything."""
    from types import SimpleNamespace

    from manylora.engine.execution.cuda_graphs import DecodeGraphs

    layers, experts = 2, 3

    def adapter(key: str, gate_up_rank: int, down_rank: int) -> SimpleNamespace:
        ranks = torch.full((layers, 7 + 2 * experts), 4, dtype=torch.int32)
        ranks[:, 7::2], ranks[:, 8::2] = gate_up_rank, down_rank
        return SimpleNamespace(key=key, ranks=ranks, scalings=torch.full(ranks.shape, 2.0))

    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the host-side check only: no GPU buffers
    graphs.expert_lora, graphs._expressible = True, {}
    good, attention_only, renamed = adapter("good", 4, 4), adapter("attn", 0, 0), adapter("renamed", 8, 4)
    assert graphs.serves([good, attention_only])
    assert not graphs.serves([good, renamed])
    assert graphs._expressible == {"good": True, "attn": True, "renamed": False}
    renamed.ranks[:, 7:] = 4  # a cached verdict is not recomputed (adapters are immutable under their key)
    assert not graphs.serves([renamed])
    graphs.expert_lora = False
    assert graphs.serves([renamed])

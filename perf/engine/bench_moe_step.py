"""Whole-model MoE decode step with LoRA on attention and experts: no LoRA / fused / unfused (GPU).

    python -m perf.engine.bench_moe_step                       # Qwen3-30B-A3B shape, on the GPU
    python -m perf.engine.bench_moe_step --shape tiny --device cpu --batches 2 --adapters 1 2   # smoke test

Builds the MoE model (manylora.engine.models.moe.MoeModel) from random bf16 weights directly on the
device (48 layers, 128 experts, top-8, hidden 2048, expert MLP 768, 32/4 heads of 128 for the
Qwen3-30B-A3B shape), a unified pool, and ``max(adapters)`` synthetic rank-16 adapters resident in
it (q/k/v/o of every layer and both expert parameters of every expert; random values). For each
batch of decode tokens (each sequence with ``--context`` tokens cached) and each number of
distinct adapters (round-robin over the tokens) it times one eager forward step (median of
triton.testing.do_bench) of:

  (a) the model without LoRA
  (b) fused: the engine's kernel path (manylora.kernels.fused_moe_lora for the experts and their LoRA)
  (c) unfused: the same grouped expert GEMMs (manylora.kernels.fused_moe), then each expert's LoRA delta in
      torch, expert by expert (LoraBatch.apply_expert: the engine's own per-expert code)

and prints step times, b/a, c/b, max |logits(b) - logits(c)| (the two LoRA paths agree) and
max |logits(b) - logits(a)| (the adapters change the output). With ``--graphs`` (CUDA) a second row
times (a) and (b) replayed from CUDA graphs, as the engine runs decode steps (the LoRA batch in graph
mode: every layer's experts through the fused kernel, tables read at replay), and how far each
replay's logits are from the eager step's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from manylora.engine.adapters.packing import _layout
from manylora.engine.execution.warmup import synthetic_adapter
from manylora.engine.layers.lora_batch import LoraBatch
from manylora.engine.layers.step_batch import DecodeRows, StepBatch
from manylora.engine.memory.adapter_slots import AdapterPool
from manylora.engine.memory.kv_cache import PagedKVCache
from manylora.engine.memory.sizing import synthetic_spec
from manylora.engine.memory.unified_pool import UnifiedPool, page_elements
from manylora.engine.model_config import ModelConfig
from manylora.engine.models.moe import MoeLayerWeights, MoeModel


@dataclass(frozen=True)
class MoeShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    vocab: int


SHAPES = {
    "qwen3-30b-a3b": MoeShape(48, 2048, 32, 4, 128, 128, 8, 768, 151936),
    "tiny": MoeShape(2, 64, 4, 2, 16, 8, 2, 32, 300),
}


def write_config(out: Path, s: MoeShape) -> ModelConfig:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": s.vocab,
        "hidden_size": s.hidden, "intermediate_size": 4 * s.hidden, "moe_intermediate_size": s.expert_intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "num_experts": s.experts, "num_experts_per_tok": s.top_k, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1,
    }))  # fmt: skip
    return ModelConfig.from_dir(out)


def random_model(cfg: ModelConfig, s: MoeShape, device: str, dtype: torch.dtype, max_len: int) -> MoeModel:
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int, fan_in: int | None = None) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        return t.mul_((fan_in or shape[-1]) ** -0.5).to(dtype)

    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    t = {"model.embed_tokens.weight": rnd(s.vocab, s.hidden, fan_in=1), "model.norm.weight": torch.ones(
        s.hidden, device=device, dtype=dtype), "lm_head.weight": rnd(s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": torch.ones(s.hidden, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(s.hidden, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": rnd(q_out, s.hidden), p + "self_attn.k_proj.weight": rnd(kv_out, s.hidden),
            p + "self_attn.v_proj.weight": rnd(kv_out, s.hidden), p + "self_attn.o_proj.weight": rnd(s.hidden, q_out),
            p + "self_attn.q_norm.weight": torch.ones(s.head_dim, device=device, dtype=dtype),
            p + "self_attn.k_norm.weight": torch.ones(s.head_dim, device=device, dtype=dtype),
            p + "mlp.gate.weight": rnd(s.experts, s.hidden),
            p + "mlp.experts.gate_up_proj": rnd(s.experts, 2 * s.expert_intermediate, s.hidden),
            p + "mlp.experts.down_proj": rnd(s.experts, s.hidden, s.expert_intermediate),
        })  # fmt: skip
    model = MoeModel(cfg, t, max_len, device, dtype)
    model.use_kernels = True
    return model


def synthetic_adapters(pool: UnifiedPool, count: int, rank: int, device: str) -> list:
    """``count`` random rank-``rank`` adapters (attention projections + experts) resident in the pool."""
    gpu = AdapterPool(pool, device)
    gen = torch.Generator(device=device).manual_seed(1)
    template = synthetic_adapter(pool, rank, rank, scaling=2.0)  # one layout for all of them
    residents = []
    for n in range(count):
        data = torch.randn(template.data.shape, generator=gen, device=device).mul_(0.02).to(pool.storage.dtype)
        spec = replace(template.spec, name=f"s{n}", sha256=f"{n:064x}")
        residents.append(gpu.upload(replace(template, spec=spec, data=data)))
        del data
    return residents


def unfused_experts(model: MoeModel):
    """A replacement for MoeModel._fused_experts: the grouped expert GEMMs of manylora.kernels.fused_moe, with each
    expert's LoRA delta added in torch between them (gate_up before the activation, down before the
    routing-weighted sum)."""
    from manylora.kernels.fused_moe import fused_moe_gemm, moe_gemm_config, moe_reduce, silu_and_mul
    from manylora.kernels.moe_align import moe_align_block_size

    cfg = model.cfg
    E, K, H, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size

    def run(x: torch.Tensor, i: int, w: MoeLayerWeights, lora: LoraBatch | None, top_w: torch.Tensor,
            top_ids: torch.Tensor) -> torch.Tensor:
        num_pairs = x.shape[0] * K
        ids = top_ids.to(torch.int32)
        cfg13, cfg2 = moe_gemm_config(num_pairs, E, 2 * inter, H), moe_gemm_config(num_pairs, E, H, inter)
        align = moe_align_block_size(ids, E, cfg13["BLOCK_M"])
        c13 = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
        fused_moe_gemm(x, w.experts_gate_up, c13, align, rows_div=K, config=cfg13)
        flat = ids.reshape(-1).long()
        pair_tokens = torch.arange(num_pairs, device=x.device) // K
        experts = flat.unique().tolist() if lora is not None and lora.has_expert_lora(i) else []
        sel_of = {e: torch.nonzero(flat == e).flatten() for e in experts}
        for e, sel in sel_of.items():
            part = c13.index_select(0, sel)
            lora.apply_expert(x.index_select(0, pair_tokens[sel]), part, pair_tokens[sel], i, e, 0)
            c13.index_copy_(0, sel, part)
        h = silu_and_mul(c13)
        c2 = torch.empty(num_pairs, H, dtype=x.dtype, device=x.device)
        fused_moe_gemm(h, w.experts_down, c2, align, rows_div=1, config=cfg2)
        for e, sel in sel_of.items():
            part = c2.index_select(0, sel)
            lora.apply_expert(h.index_select(0, sel), part, pair_tokens[sel], i, e, 1)
            c2.index_copy_(0, sel, part)
        c2 = c2 * top_w.reshape(-1, 1).to(c2.dtype)
        return moe_reduce(c2, x.shape[0], K, x.dtype)

    return run


def decode_batch(kv: PagedKVCache, tables: list[list[int]], context: int, vocab: int, device: str) -> StepBatch:
    n = len(tables)
    page_size = kv.page_size
    last = context - 1
    slots = [t[last // page_size] * page_size + last % page_size for t in tables]
    rows = torch.arange(n, device=device)
    return StepBatch(
        input_ids=torch.randint(4, vocab, (n,), device=device), positions=torch.full((n,), last, device=device),
        kv_slots=torch.tensor(slots, device=device), sequences=[], logits_rows=rows,
        decode=DecodeRows(rows=rows, block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                          seq_lens=torch.full((n,), context, dtype=torch.int32, device=device),
                          all_rows=True))  # fmt: skip


def timer(device: str):
    """Median milliseconds of fn(). On CUDA: triton's do_bench, except for calls slower than 0.3 s (the
    unfused path at large batches), which are timed three times instead of for do_bench's fixed span."""
    if device.startswith("cuda"):
        import triton.testing

        def bench(fn) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if time.perf_counter() - t < 0.3:
                return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[1]

        return bench

    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return once


def graphed(fn) -> tuple:
    """(replay, output): fn captured in a CUDA graph after two warm-up calls on a side stream (as
    manylora/engine/execution/cuda_graphs.py captures decode steps); output is the tensor each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--graphs", action="store_true",
                   help="also time the base and fused steps replayed from CUDA graphs (CUDA only), as the engine "
                        "runs decode steps")
    p.add_argument("--unfused-max-batch", type=int, default=64,
                   help="time the unfused path only up to this batch (it takes ~0.1 s per token on the H200)")
    p.add_argument("--lora-form", choices=["auto", "pairs", "blocks"], default="auto",
                   help="the fused MoE-LoRA kernels' form (kernels.fused_moe_lora: pairs up to 2048 (token, k) "
                        "pairs, blocks above, by default)")
    p.add_argument("--profile", action="store_true",
                   help="with --graphs: also print the replayed steps' kernels by GPU time (torch.profiler)")
    p.add_argument("--out", default="perf/results", help="where --profile appends moe_step_kernels.txt")
    a = p.parse_args(argv)
    if a.lora_form != "auto":
        os.environ["MANYLORA_MOE_LORA_FORM"] = a.lora_form
    s = SHAPES[a.shape]
    device = a.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="manylora-moe-step-") as tmp:
        cfg = write_config(Path(tmp), s)
    model = random_model(cfg, s, device, dtype, max_len=a.context + 8)
    page_size = a.page_size
    seq_pages = -(-a.context // page_size)
    adapter_pages = _layout(synthetic_spec(cfg, a.rank), cfg, page_elements(cfg, page_size))[0]
    num_pages = max(a.batches) * seq_pages + max(a.adapters) * adapter_pages + 1
    pool = UnifiedPool(cfg, num_pages, page_size, dtype, device)
    kv = PagedKVCache(pool)
    residents = synthetic_adapters(pool, max(a.adapters), a.rank, device)
    tables = [pool.pages.allocate(f"seq{b}", seq_pages) for b in range(max(a.batches))]
    kv_pages = [page for t in tables for page in t]  # allocated one after another: one range
    pool.storage[min(kv_pages) * pool.page_elems:(max(kv_pages) + 1) * pool.page_elems].normal_(0, 1)
    bench, fused, unfused = timer(device), model._fused_experts, unfused_experts(model)
    gb = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"{gb}: {a.shape} ({s.layers} layers, {s.experts} experts top-{s.top_k}, hidden {s.hidden}, "
          f"expert MLP {s.expert_intermediate}), {dtype}, rank-{a.rank} adapters on q/k/v/o and every expert, "
          f"context {a.context}, MoE-LoRA kernels' form {a.lora_form}; model and adapters built in "
          f"{time.time() - t0:.0f} s")
    head = f"{'batch':>5} {'adapters':>8} | {'(a) base':>9} {'(b) fused':>9} {'(c) unfused':>11} | {'b/a':>5} " \
           f"{'c/b':>5} | {'max|b-c|':>8} {'max|b-a|':>8}"
    print("step times in ms (median, eager)\n" + head + "\n" + "-" * len(head))
    for batch in a.batches:
        step = decode_batch(kv, tables[:batch], a.context, s.vocab, device)
        seen = set()
        for n in a.adapters:
            if min(n, batch) in seen:  # more adapters than rows: the same batch as a row already timed
                continue
            seen.add(min(n, batch))
            lora = LoraBatch([i % n for i in range(batch)], residents[:min(n, batch)], pool.storage, device,
                             use_kernels=True)
            model._fused_experts = fused
            logits_b = model.forward(step, kv, lora)
            logits_a = model.forward(step, kv, None)
            tb = bench(lambda step=step, lora=lora: model.forward(step, kv, lora))
            ta = bench(lambda step=step: model.forward(step, kv, None))
            lora_effect = (logits_b - logits_a).abs().max().item()  # the LoRA deltas are not negligible
            if batch <= a.unfused_max_batch:
                model._fused_experts = unfused
                logits_c = model.forward(step, kv, lora)
                tc = bench(lambda step=step, lora=lora: model.forward(step, kv, lora))
                model._fused_experts = fused
                diff = (logits_b - logits_c).abs().max().item()
                unfused_cols = f"{tc:>11.2f} | {tb / ta:>5.2f} {tc / tb:>5.1f} | {diff:>8.2e}"
            else:
                unfused_cols = f"{'not run':>11} | {tb / ta:>5.2f} {'-':>5} | {'-':>8}"
            print(f"{batch:>5} {min(n, batch):>8} | {ta:>9.2f} {tb:>9.2f} {unfused_cols} {lora_effect:>8.2e}",
                  flush=True)
            if a.graphs and device.startswith("cuda"):
                graph_lora = LoraBatch.from_tables(lora.token_slots, lora.row_offsets, lora.ranks, lora.scalings,
                                                   pool.storage, graph_experts=True)
                logits_g = model.forward(step, kv, graph_lora)  # eager, the graph-mode tables: the same kernels
                base_replay, base_out = graphed(lambda step=step: model.forward(step, kv, None))
                fused_replay, fused_out = graphed(lambda step=step, lo=graph_lora: model.forward(step, kv, lo))
                tga, tgb = bench(base_replay), bench(fused_replay)
                base_replay()
                fused_replay()
                torch.cuda.synchronize()
                diff_a = (base_out - logits_a).abs().max().item()
                diff_g = (fused_out - logits_g).abs().max().item()
                diff_b = (logits_g - logits_b).abs().max().item()
                # the same eager step once more: what rounding alone moves (split-K atomics), through 48 random layers
                noise = (model.forward(step, kv, lora) - logits_b).abs().max().item()
                print(f"{'':>5} {'graphs':>8} | {tga:>9.2f} {tgb:>9.2f} {'':>11} | {tgb / tga:>5.2f} {'':>5} | "
                      f"replay vs eager: base {diff_a:.2e}, fused {diff_g:.2e}; graph-mode vs eager batch "
                      f"{diff_b:.2e}; eager again {noise:.2e}", flush=True)
                if a.profile:
                    from perf.engine.bench_decode_step import profile_kernels

                    for label, replay in (("base", base_replay), (f"{min(n, batch)} adapters", fused_replay)):
                        profile_kernels(replay, f"batch {batch}, {label}", Path(a.out),
                                        file_name="moe_step_kernels.txt")
    print(f"total wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

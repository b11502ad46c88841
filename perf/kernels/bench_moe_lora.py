"""GPU timing of the fused MoE-LoRA kernels, one Qwen3-30B-A3B MoE layer (not a test; needs CUDA).

    python -m perf.kernels.bench_moe_lora        (from the repository root)

Shape per layer: 128 experts, top-8, hidden 2048, expert MLP 768 (SwiGLU), bf16; LoRA rank 16 on
w13 (one slice over gate+up) and w2 of every expert, 32 adapter slots resident in the pool.
For each batch of 1/16/64/256 tokens with 1/8/32 distinct adapters (round-robin over tokens), the
median time (triton.testing.do_bench) of:

  (a) fused MoE without LoRA                   manylora.kernels.fused_moe.fused_moe
  (b) fused MoE-LoRA                           manylora.kernels.fused_moe_lora.fused_moe_lora_forward
  (c) unfused: the same base grouped GEMMs, then the LoRA per expert in a Python loop over the
      experts present (torch gathers + bmm per expert, delta13 before the activation, delta2
      before the routing-weighted sum)

(a) and (b) are eager calls (alignment metadata included, as a model would run them per layer);
"graph" columns replay the same call in a CUDA graph (launch overhead removed). (c) reads the
routed experts back to the host, so it cannot be graphed. Times are per layer: the model has
48 MoE layers; no extrapolation is printed.
"""

from __future__ import annotations

import time

import torch
import triton.testing

from manylora.kernels.fused_moe import fused_moe, fused_moe_gemm, moe_gemm_config, moe_reduce, silu_and_mul
from manylora.kernels.fused_moe_lora import MoeLora, fused_moe_lora_forward
from manylora.kernels.moe_align import moe_align_block_size

NUM_LAYERS = 48
E, TOP_K, HIDDEN, INTER, RANK, SLOTS = 128, 8, 2048, 768, 16, 32
DTYPE = torch.bfloat16


def make_adapters(gen: torch.Generator):
    """Dense per-(slot, expert) adapter tensors that are views of one flat pool, and the tables."""
    shapes = {
        "a13": (SLOTS, E, RANK, HIDDEN),
        "b13": (SLOTS, E, RANK, 2 * INTER),  # rows of B13^T
        "a2": (SLOTS, E, RANK, INTER),
        "b2": (SLOTS, E, RANK, HIDDEN),  # rows of B2^T
    }
    sizes = {k: s[0] * s[1] * s[2] * s[3] for k, s in shapes.items()}
    pool = torch.empty(sum(sizes.values()), dtype=DTYPE, device="cuda")
    pool.normal_(0, 0.02, generator=gen)
    dense, offsets, base = {}, {}, 0
    for k, s in shapes.items():
        dense[k] = pool[base : base + sizes[k]].view(s)
        rows = torch.arange(s[0] * s[1] * s[2], device="cuda", dtype=torch.int64).view(s[:3])
        offsets[k] = base + rows * s[3]
        base += sizes[k]
    return pool, dense, offsets


def unfused_moe_lora(x, w13, w2, topk_ids, topk_weights, token_slots, dense, scalings):
    """(c): base grouped GEMMs + per-expert Python loop of torch matmuls for the LoRA."""
    num_tokens = x.shape[0]
    num_pairs = num_tokens * TOP_K
    cfg13 = moe_gemm_config(num_pairs, E, 2 * INTER, HIDDEN)
    cfg2 = moe_gemm_config(num_pairs, E, HIDDEN, INTER)
    align = moe_align_block_size(topk_ids, E, cfg13["BLOCK_M"])
    ids = topk_ids.reshape(-1).long()
    pair_slots = token_slots.long().repeat_interleave(TOP_K)
    pair_tokens = torch.arange(num_pairs, device=x.device) // TOP_K
    experts = ids[pair_slots >= 0].unique().tolist()  # host read: the loop needs it
    sel_of = {e: torch.nonzero((ids == e) & (pair_slots >= 0)).flatten() for e in experts}

    c13 = torch.empty(num_pairs, 2 * INTER, dtype=x.dtype, device=x.device)
    fused_moe_gemm(x, w13, c13, align, rows_div=TOP_K, config=cfg13)
    for e in experts:
        sel = sel_of[e]
        s = pair_slots[sel]
        y = torch.bmm(x[pair_tokens[sel]].unsqueeze(1), dense["a13"][s, e].transpose(1, 2))  # [n, 1, r]
        d = torch.bmm(y, dense["b13"][s, e]).squeeze(1) * scalings[s, None].to(x.dtype)
        c13.index_add_(0, sel, d)
    h = silu_and_mul(c13)
    c2 = torch.empty(num_pairs, HIDDEN, dtype=x.dtype, device=x.device)
    fused_moe_gemm(h, w2, c2, align, rows_div=1, config=cfg2)
    for e in experts:
        sel = sel_of[e]
        s = pair_slots[sel]
        y = torch.bmm(h[sel].unsqueeze(1), dense["a2"][s, e].transpose(1, 2))
        d = torch.bmm(y, dense["b2"][s, e]).squeeze(1) * scalings[s, None].to(x.dtype)
        c2.index_add_(0, sel, d)
    c2 = c2 * topk_weights.reshape(-1, 1).to(c2.dtype)
    return moe_reduce(c2, num_tokens, TOP_K, x.dtype)


def bench(fn, graph: bool = False) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("perf/kernels/bench_moe_lora.py needs a CUDA GPU")
    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=gen).mul_(HIDDEN**-0.5).to(DTYPE)
    w2 = torch.randn(E, HIDDEN, INTER, device="cuda", generator=gen).mul_(INTER**-0.5).to(DTYPE)
    pool, dense, offs = make_adapters(gen)
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
    scalings = torch.full((SLOTS,), 2.0, dtype=torch.float32, device="cuda")

    print(f"{torch.cuda.get_device_name()}, Qwen3-30B-A3B MoE layer: E={E} top-{TOP_K} H={HIDDEN} I={INTER}, "
          f"bf16, LoRA rank {RANK} on w13+w2, {SLOTS} slots in the pool")  # fmt: skip
    print(f"per-layer times in microseconds (median); the model has {NUM_LAYERS} MoE layers")
    head = (
        f"{'tokens':>6} {'adapters':>8} | {'(a) base':>9} {'(b) lora':>9} {'(c) unfused':>11} | "
        f"{'b/a':>5} {'c/b':>6} | {'a graph':>8} {'b graph':>8} {'b/a gr':>6} | {'max|b-c|':>8}"
    )
    print(head)
    print("-" * len(head))
    for num_tokens in (1, 16, 64, 256):
        x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).to(DTYPE)
        logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
        topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
        topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
        topk_ids = topk_ids.to(torch.int32)
        for num_adapters in (1, 8, 32):
            chosen = torch.randperm(SLOTS, device="cuda", generator=gen)[:num_adapters]
            token_slots = chosen[torch.arange(num_tokens, device="cuda") % num_adapters].to(torch.int32)
            lora = MoeLora(pool, offs["a13"], offs["b13"], offs["a2"], offs["b2"], ranks, scalings, token_slots)
            args = (x, w13, w2, topk_ids, topk_weights)

            def run_a(args=args):
                return fused_moe(*args)

            def run_b(args=args, lora=lora):
                return fused_moe_lora_forward(*args, lora)

            def run_c(args=args, token_slots=token_slots):
                return unfused_moe_lora(*args, token_slots, dense, scalings)

            diff = (run_b().float() - run_c().float()).abs().max().item()
            ta, tb, tc = bench(run_a), bench(run_b), bench(run_c)
            ga, gb = bench(run_a, graph=True), bench(run_b, graph=True)
            print(
                f"{num_tokens:>6} {min(num_adapters, num_tokens):>8} | {ta:>9.1f} {tb:>9.1f} {tc:>11.1f} | "
                f"{tb / ta:>5.2f} {tc / tb:>6.1f} | {ga:>8.1f} {gb:>8.1f} {gb / ga:>6.2f} | {diff:>8.2e}"
            )
    print(f"total bench wall time {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()

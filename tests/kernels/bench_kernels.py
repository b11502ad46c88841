"""Rough GPU timings of the kernels (not a test): python tests/kernels/bench_kernels.py

Reports microseconds and the effective bandwidth over the bytes the kernel must read
(adapter rows of the slots in use, x, the KV of the batch) on Llama-8B-like shapes, bf16.
"""

from __future__ import annotations

from functools import partial

import torch
import triton.testing

from kernels.lora_expand import lora_expand
from kernels.lora_meta import build_segments
from kernels.lora_shrink import lora_shrink
from kernels.paged_attention import paged_decode_attention


def lora_inputs(num_tokens, num_slots, rank, in_features, widths, dtype=torch.bfloat16):
    ns = len(widths)
    row_len = max(in_features, *widths)
    num_rows = 2 * ns * num_slots * rank
    pool = torch.randn(num_rows * row_len, dtype=dtype, device="cuda") * 0.05
    rows = torch.randperm(num_rows, device="cuda").view(2, ns, num_slots, rank) * row_len
    ranks = torch.full((ns, num_slots), rank, dtype=torch.int32, device="cuda")
    scal = torch.ones(ns, num_slots, device="cuda")
    slots = torch.randint(num_slots, (num_tokens,), dtype=torch.int32, device="cuda")
    x = torch.randn(num_tokens, in_features, dtype=dtype, device="cuda")
    return x, pool, rows[0].contiguous(), rows[1].contiguous(), ranks, scal, slots


def main():
    in_f, widths, rank = 4096, [4096, 1024, 1024], 16
    print("LoRA qkv, in=4096, out=4096+1024+1024, rank 16, bf16")
    for num_tokens, num_slots in [(1, 1), (16, 16), (64, 8), (256, 32), (2048, 8)]:
        x, pool, a_offs, b_offs, ranks, scal, slots = lora_inputs(num_tokens, num_slots, rank, in_f, widths)
        used = int(slots.unique().numel())
        seg = build_segments(slots)
        y = torch.empty(3, num_tokens, rank, device="cuda")
        base = torch.zeros(num_tokens, sum(widths), dtype=torch.bfloat16, device="cuda")
        bounds = [0, 4096, 5120, 6144]
        a_bytes = used * 3 * rank * in_f * 2 + x.numel() * 2
        b_bytes = used * rank * sum(widths) * 2 + 2 * base.numel() * 2
        for name, segments in (("bgmv", None), ("sgmv", seg)):
            shrink = partial(lora_shrink, x, pool, a_offs, ranks, slots, y, segments=segments)
            expand = partial(lora_expand, y, pool, b_offs, ranks, scal, slots, base, bounds, segments=segments)
            t_s, t_e = triton.testing.do_bench(shrink), triton.testing.do_bench(expand)
            g_s, g_e = triton.testing.do_bench_cudagraph(shrink), triton.testing.do_bench_cudagraph(expand)
            print(
                f"  T={num_tokens:5d} slots={used:3d} {name}: "
                f"shrink {t_s * 1e3:6.1f} us eager, {g_s * 1e3:6.1f} us graph "
                f"({a_bytes / g_s / 1e6:7.1f} GB/s); expand {t_e * 1e3:6.1f} us eager, {g_e * 1e3:6.1f} us graph "
                f"({b_bytes / g_e / 1e6:7.1f} GB/s)"
            )

    print("paged decode attention, 32 heads / 8 kv heads, d=128, page 16, 32 layers, bf16")
    num_layers, page, nkv, group, d = 32, 16, 8, 4, 128
    for batch, seq in [(1, 1024), (64, 512), (64, 4096), (256, 1024)]:
        pages_per = seq // page
        num_pages = batch * pages_per
        page_elems = num_layers * 2 * page * nkv * d
        pool = torch.randn(num_pages * page_elems, dtype=torch.bfloat16, device="cuda")
        bt = torch.randperm(num_pages, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, pages_per)
        lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, nkv * group, d, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        attn = partial(
            paged_decode_attention, q, pool, bt, lens, d**-0.5, out,
            layer=5, num_layers=num_layers, page_size=page, num_kv_heads=nkv,
        )  # fmt: skip
        t, g = triton.testing.do_bench(attn), triton.testing.do_bench_cudagraph(attn)
        kv_bytes = batch * seq * 2 * nkv * d * 2
        print(f"  B={batch:4d} seq={seq:5d}: {t * 1e3:6.1f} us eager, {g * 1e3:6.1f} us graph", end="")
        print(f" ({kv_bytes / g / 1e6:7.1f} GB/s)")


if __name__ == "__main__":
    main()

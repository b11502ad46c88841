"""A slot-major decode shrink against BGMV, kernels alone (an experiment: is reading each adapter once worth it?).

BGMV's shrink gives every token its own programs, so an adapter serving m tokens of a step has its A rows read m
times (from L2 after the first): at 64 tokens the q/k/v shrink streams 64 x 384 KB through the SMs whatever the
number of distinct adapters. Here one program per (slot, K block, slice) reads its slot's A block once and
multiplies it with every token of the step as one tl.dot tile, the rows of other slots' tokens masked off (no
tables, a fixed grid over the pool's slots: programs of slots absent from the step return after reading the step's
slot ids), adding its partial sums into the zeroed fp32 output with atomics.

    python3 -m perf.bench_dense_shrink --tokens 64 --distinct 1,8,16,32,64 --slots 64
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.lora_shrink import lora_shrink


@triton.jit
def dense_masked_shrink_kernel(
    x_ptr, pool_ptr, a_row_offsets_ptr, ranks_ptr, token_slots_ptr, out_ptr,
    num_tokens, in_features,
    stride_xm, stride_as, stride_aslot, stride_ar, stride_rs, stride_rslot, stride_os, stride_om, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_BLOCKS: tl.constexpr,
):  # fmt: skip
    """out[i, t, :r] += A_i[slot(t)][:, kb] @ x[t, kb] for the tokens t of this program's slot; grid (S, splits, NS)."""
    slot = tl.program_id(0)
    pid_k = tl.program_id(1)
    slice_id = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    m_slots = tl.load(token_slots_ptr + offs_m, mask=offs_m < num_tokens, other=-1)
    m_mask = m_slots == slot
    if tl.sum(m_mask.to(tl.int32), axis=0) == 0:
        return
    slot64 = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slice_id * stride_rs + slot64 * stride_rslot)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    row_offs = tl.load(a_row_offsets_ptr + slice_id * stride_as + slot64 * stride_aslot + offs_r * stride_ar,
                       mask=r_mask, other=0).to(tl.int64)  # fmt: skip
    row_offs = tl.multiple_of((row_offs // 8) * 8, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k0 = pid_k * (K_BLOCKS * BLOCK_K)
    for kb in tl.static_range(K_BLOCKS):
        offs_k = k0 + kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        a = tl.load(pool_ptr + row_offs[:, None] + offs_k[None, :], mask=r_mask[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(a))
    out_ptrs = out_ptr + slice_id * stride_os + offs_m[:, None] * stride_om + offs_r[None, :] * stride_or
    tl.atomic_add(out_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :], sem="relaxed")


def dense_masked_shrink(x, pool, a_offs, ranks, slots, out, block_k: int, k_blocks: int, warps: int) -> None:
    ns, num_slots, r = a_offs.shape
    t, k = x.shape
    out.zero_()
    grid = (num_slots, k // (block_k * k_blocks), ns)
    dense_masked_shrink_kernel[grid](
        x, pool, a_offs, ranks, slots, out, t, k,
        x.stride(0), *a_offs.stride(), *ranks.stride(), *out.stride(),
        BLOCK_M=max(16, triton.next_power_of_2(t)), BLOCK_R=max(16, r), BLOCK_K=block_k, K_BLOCKS=k_blocks,
        num_warps=warps,
    )  # fmt: skip


GROUPS = {"qkv": (4096, 3), "gate_up": (4096, 2), "o": (4096, 1), "down": (14336, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--distinct", default="1,8,16,32,64")
    ap.add_argument("--slots", type=int, default=64, help="adapter slots of the pool (the grid's first axis)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--groups", default="qkv,gate_up,o,down")
    ap.add_argument("--configs", default="128x1x4,128x2x4,256x1x4,64x2x2,128x4x4")
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    dev, dtype, r = "cuda", torch.bfloat16, args.rank
    gen = torch.Generator().manual_seed(0)
    rows = []
    for group in args.groups.split(","):
        k, ns = GROUPS[group]
        # a graph of one call per copy of the pool's adapters (~1 GB in all), so that A comes from HBM, not L2
        copies = max(8, (1 << 30) // (ns * args.slots * r * k * 2))
        pool = torch.randn(copies * ns * args.slots * r * k, dtype=dtype, device=dev) * 0.02
        base = torch.arange(ns * args.slots * r, device=dev, dtype=torch.int64).view(ns, args.slots, r) * k
        offs = [base + c * ns * args.slots * r * k for c in range(copies)]
        ranks = torch.full((ns, args.slots), r, dtype=torch.int32, device=dev)
        x = torch.randn(args.tokens, k, dtype=dtype, device=dev)
        for distinct in [int(d) for d in args.distinct.split(",")]:
            slots = (torch.arange(args.tokens) % distinct)[torch.randperm(args.tokens, generator=gen)]
            slots = (slots * (args.slots // distinct)).to(torch.int32).to(dev)  # spread over the pool's slots
            ref = torch.zeros(ns, args.tokens, r, device=dev)
            lora_shrink(x, pool, offs[0], ranks, slots, ref)
            out = torch.zeros_like(ref)

            def bgmv(a_offs, x=x, pool=pool, ranks=ranks, slots=slots, out=out):
                lora_shrink(x, pool, a_offs, ranks, slots, out)

            row = {"group": group, "distinct": distinct, "bgmv_us": bench(bgmv, offs)}
            for spec in args.configs.split(","):
                bk, kb, w = (int(v) for v in spec.split("x"))
                if k % (bk * kb):
                    continue
                dense_masked_shrink(x, pool, offs[0], ranks, slots, out, bk, kb, w)
                err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                assert err < 1e-3, (group, distinct, spec, err)

                def dense(a_offs, bk=bk, kb=kb, w=w, x=x, pool=pool, ranks=ranks, slots=slots, out=out):
                    dense_masked_shrink(x, pool, a_offs, ranks, slots, out, bk, kb, w)

                row[spec] = bench(dense, offs)
            rows.append(row)
            best = min((v, s) for s, v in row.items() if s not in ("group", "distinct", "bgmv_us"))
            print(f"{group:>8} {distinct:>3} adapters: bgmv {row['bgmv_us']:6.2f} us, dense best {best[0]:6.2f} us "
                  f"({best[1]}), ratio {best[0] / row['bgmv_us']:.2f}", flush=True)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "dense_shrink.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def bench(fn, offs: list[torch.Tensor]) -> float:
    """Median microseconds of ``fn(a_offs)`` a call, replayed from a CUDA graph of one call per pool copy."""

    def all_copies():
        for a_offs in offs:
            fn(a_offs)

    return triton.testing.do_bench_cudagraph(all_copies, rep=200, return_mode="median") * 1e3 / len(offs)


if __name__ == "__main__":
    main()

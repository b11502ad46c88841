"""Can programmatic dependent launch hide a decode GEMM's boundary cost, if the GEMM prefetches its weight early?

Each cuBLASLt GEMM of a decode step at 64 rows takes 3.5-4 us more than its bytes at the copy bandwidth (perf/results/
2026-12-03-h200/21_cublaslt): the pipeline fills after the kernel before it has finished. Here a chain of ``--layers``
[RMSNorm, GEMM] pairs over distinct weights (more bytes than L2 holds), captured in a CUDA graph, as:

* ``cublaslt``: the Triton norm, then F.linear through cuBLASLt (the engine's decode graphs);
* ``triton``: the Triton norm, then a plain Triton GEMM (one program per BLOCK_N columns, all 64 rows, whole K);
* ``pdl``: both launched with PDL: each kernel lets its successor be scheduled as soon as it starts and waits
  (``griddepcontrol.wait``) for its predecessor before touching memory the predecessor writes;
* ``pdl+pfK``: as ``pdl``, and each GEMM program, before it waits, asks L2 for the first K columns of its weight rows
  (the weight does not depend on the norm): the weight stream starts while the norm runs.

    python3 -m perf.bench_pdl_chain --shapes qkv,o,gate_up --variants cublaslt,triton,pdl,pdl+pf512,pdl+pf1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK_N = {"qkv": 64, "o": 32, "gate_up": 64, "down": 32}  # kernels.skinny_gemm.gemm_config's at 64 rows (no split)


@triton.jit
def _norm_kernel(h_ptr, w_ptr, x_ptr, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x is read by the previous GEMM
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    h = tl.load(h_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    rms = tl.rsqrt(tl.sum(h * h, axis=0) / K + 1e-5)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * K + offs, (h * rms * w).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, N, k_len, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr):  # fmt: skip
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH_K > 0:  # the first PREFETCH_K columns of this program's weight rows, one 128-byte line a lane
        LINES: tl.constexpr = PREFETCH_K // 64
        lane = tl.arange(0, BLOCK_N * LINES)
        rows = pid_n * BLOCK_N + lane // LINES
        ptrs = w_ptr + rows.to(tl.int64) * K + (lane % LINES) * 64
        done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        tl.store(out_ptr + lane, done.to(out_ptr.dtype.element_ty), mask=lane < N * 0 - 1)  # never: keeps the asm
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the norm
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :])
        w_t = tl.load(w_cols + offs_k[:, None])
        acc += tl.dot(x, w_t)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up")
    ap.add_argument("--variants", default="cublaslt,triton,pdl,pdl+pf256,pdl+pf512,pdl+pf1024,pdl+pf2048")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    dev, dtype, rows = "cuda", torch.bfloat16, 64
    torch.manual_seed(0)
    graphs, checks = {}, []
    keep = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(args.layers)]
        h = torch.randn(rows, k, device=dev, dtype=dtype)
        norm_w = torch.rand(k, device=dev, dtype=dtype) + 0.5
        x = torch.empty(rows, k, device=dev, dtype=dtype)
        outs = [torch.empty(rows, n, device=dev, dtype=dtype) for _ in weights]
        keep.append((weights, h, norm_w, x, outs))
        ref = F.linear((h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()).to(
            dtype).float(), weights[-1].float())  # fmt: skip
        for variant in args.variants.split(","):
            pdl = variant.startswith("pdl")
            prefetch = int(variant.split("+pf")[1]) if "+pf" in variant else 0
            launch = {"launch_pdl": True} if pdl else {}

            def body(variant=variant, pdl=pdl, prefetch=prefetch, launch=launch, weights=weights, h=h,
                     norm_w=norm_w, x=x, outs=outs, n=n, k=k, shape=shape):  # fmt: skip
                for w, out in zip(weights, outs, strict=True):
                    block = triton.next_power_of_2(k)
                    _norm_kernel[(rows,)](h, norm_w, x, K=k, BLOCK=block, PDL=pdl, num_warps=8, **launch)
                    if variant == "cublaslt":
                        torch.matmul(x, w.t(), out=out)
                    else:
                        _gemm_kernel[(n // BLOCK_N[shape],)](
                            x, w, out, n, k, K=k, BLOCK_M=rows, BLOCK_N=BLOCK_N[shape], BLOCK_K=128, PDL=pdl,
                            PREFETCH_K=prefetch, num_warps=4, num_stages=5, **launch,
                        )  # fmt: skip

            body()
            torch.cuda.synchronize()
            err = ((outs[-1].float() - ref).abs().max() / ref.abs().max()).item()
            checks.append({"shape": shape, "variant": variant, "max_rel_err": round(err, 5)})
            assert err < 2e-2, (shape, variant, err)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            graphs[(shape, variant)] = g
    torch.cuda.synchronize()

    def time_us(g: torch.cuda.CUDAGraph) -> float:
        for _ in range(3):
            g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.iters):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / args.iters / args.layers

    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for key, g in graphs.items():
            times.setdefault(key, []).append(time_us(g))
    rows_out = []
    print(f"{'shape':>8} {'variant':>12} {'us/pair':>8} {'vs cublaslt':>11}")
    for (shape, variant), ts in times.items():
        med = statistics.median(ts)
        base = statistics.median(times[(shape, "cublaslt")]) if (shape, "cublaslt") in times else med
        rows_out.append({"shape": shape, "variant": variant, "us": round(med, 2), "rounds": [round(t, 2) for t in ts],
                         "vs_cublaslt": round(med / base, 3)})  # fmt: skip
        print(f"{shape:>8} {variant:>12} {med:>8.2f} {med / base:>11.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "pdl_chain.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "args": vars(args), "checks": checks, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()

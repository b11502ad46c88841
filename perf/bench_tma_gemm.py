"""Does a Triton GEMM fed by Hopper's tensor memory accelerator stream a decode GEMM's weight faster than cuBLASLt?

At 64 rows a decode step's base GEMMs are streams over their weights: cuBLASLt takes each weight's bytes at about
the copy bandwidth plus a fixed ~4 us (perf/results/2026-12-03-h200/21_cublaslt), and the four GEMMs of a layer run
at 1.215x their bytes floor (2026-12-04-h200/1_persistent_chain). The Triton GEMMs tried so far loaded their tiles
with pointer loads (kernels/skinny_gemm.py: 0.95-0.97x cuBLAS's speed at best). Here each program's weight and
input tiles come through TMA descriptors (``desc.load``: one bulk copy per tile, completed on an mbarrier, no
address arithmetic in the warps), software-pipelined ``STAGES`` deep, the K axis split ``split`` ways with fp32
atomics into a zeroed output (the memset is inside the timed graph) or, unsplit, stored in bf16.

Per shape (Llama-3-8B widths at 64 rows: q/k/v 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down 4096 x
14336), a CUDA graph of ``--layers`` GEMMs over distinct weights (more bytes than L2 holds), cuBLASLt against each
config of the sweep; every config is checked against torch first.

    python3 -m perf.bench_tma_gemm --layers 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROWS = 64
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMEM_LIMIT = 220 * 1024


@triton.jit(do_not_specialize=["k_split_len"])
def _tma_gemm_kernel(x_desc, w_desc, out_ptr, k_split_len, stride_om, M: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, ATOMIC: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """out[M, N] (+)= x[M, K] @ w[N, K]^T for column block program_id(0) over K split program_id(1).

    x_desc: descriptor of x [M, K] bf16, block [M, BK]; w_desc: of w [N, K] bf16, block [BN, BK]. ATOMIC: out is
    fp32 and zeroed, each split adds its partial sum; else out is bf16 and one split stores it.
    """
    n0 = tl.program_id(0) * BN
    k_start = tl.program_id(1) * k_split_len
    acc = tl.zeros((M, BN), dtype=tl.float32)
    for k in tl.range(k_start, k_start + k_split_len, BK, num_stages=STAGES):
        x = x_desc.load([0, k])
        w = w_desc.load([n0, k])
        acc = tl.dot(x, w.T, acc)
    offs_m = tl.arange(0, M)
    offs_n = n0 + tl.arange(0, BN)
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty))


class TmaGemm:
    """One config's launches of ``_tma_gemm_kernel`` over a stack of weights [layers, N, K] and one input."""

    def __init__(self, x: torch.Tensor, weights: torch.Tensor, bn: int, bk: int, stages: int, split: int) -> None:
        layers, n, k = weights.shape
        rows = x.shape[0]
        self.bn, self.bk, self.stages, self.split = bn, bk, stages, split
        self.k_split_len = k // split
        self.x_desc = TensorDescriptor.from_tensor(x, [rows, bk])
        self.w_descs = [TensorDescriptor.from_tensor(weights[i], [bn, bk]) for i in range(layers)]
        dtype = torch.float32 if split > 1 else x.dtype
        self.outs = torch.empty(layers, rows, n, device=x.device, dtype=dtype)
        self.grid = (n // bn, split)

    def run(self, layer: int) -> torch.Tensor:
        out = self.outs[layer]
        if self.split > 1:
            out.zero_()
        _tma_gemm_kernel[self.grid](self.x_desc, self.w_descs[layer], out, self.k_split_len, out.stride(0),
                                    M=out.shape[0], BN=self.bn, BK=self.bk, ATOMIC=self.split > 1,
                                    STAGES=self.stages, num_warps=4, num_stages=self.stages)  # fmt: skip
        return out


def configs(n: int, k: int, sms: int, rows: int = ROWS) -> list[tuple[int, int, int, int]]:
    """(BN, BK, STAGES, split) worth timing for an [n, k] weight: pipelined tiles that fit in shared memory and
    grids of 0.7-2.3 waves of one program an SM."""
    out = []
    for bn, bk, stages, split in itertools.product((64, 128, 256), (64, 128), (3, 5, 7), (1, 2, 3, 4, 6, 8)):
        if n % bn or k % (bk * split):
            continue
        if stages * (rows * bk + bn * bk) * 2 > SMEM_LIMIT:
            continue
        if not 0.7 * sms <= (n // bn) * split <= 2.3 * sms:
            continue
        out.append((bn, bk, stages, split))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def time_ms(run, iters: int) -> float:
    """Mean ms of ``iters`` calls of run after two warm-up calls, by device events."""
    for _ in range(2):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(iters: int) -> float:
    """Bytes a second of a 1 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = statistics.median(time_ms(lambda: dst.copy_(src), iters) for _ in range(3))
    return 2 * src.numel() / (copy_ms * 1e-3)


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float, sms: int) -> tuple[list[dict], tuple]:
    """Check and time cuBLASLt and every TMA config for one shape; (result rows, summary row)."""
    n, k = SHAPES[shape]
    layers = args.layers
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(layers, n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    x = torch.randn(ROWS, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = x.float() @ weights[0].float().t()
    floor_us = n * k * 2 / bandwidth * 1e6
    out_lt = torch.empty(layers, ROWS, n, device="cuda", dtype=torch.bfloat16)

    def lt_body() -> None:
        for i in range(layers):
            torch.matmul(x, weights[i].t(), out=out_lt[i])

    results: list[dict] = []
    variants = {"cublaslt": lt_body}
    for bn, bk, stages, split in configs(n, k, sms):
        name = f"tma {bn}x{bk}x{stages} split{split}"
        try:
            gemm = TmaGemm(x, weights, bn, bk, stages, split)
            err = rel_err(gemm.run(0), ref)
            torch.cuda.synchronize()
            if not err < 1e-2:
                raise AssertionError(f"relative error {err:.3g}")
            variants[name] = lambda gemm=gemm: [gemm.run(i) for i in range(layers)]
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
            results.append({"shape": shape, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(shape, name, results[-1]["error"], flush=True)
    lt_body()
    results.append({"shape": shape, "variant": "cublaslt", "rel_err": round(rel_err(out_lt[0], ref), 5)})
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for name, body in variants.items():
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graphs[name] = graph
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times.setdefault(name, []).append(time_ms(graph.replay, args.iters) * 1e3 / layers)
    base = statistics.median(times["cublaslt"])
    ranked = sorted((statistics.median(ts), name) for name, ts in times.items())
    for med, name in ranked:
        results.append({"shape": shape, "variant": name, "us": round(med, 2), "x_floor": round(med / floor_us, 3),
                        "vs_cublaslt": round(med / base, 3), "rounds": [round(t, 2) for t in times[name]]})
    best = next(((med, name) for med, name in ranked if name != "cublaslt"), (float("nan"), "none"))
    print(f"{shape}: floor {floor_us:.1f} us, cublaslt {base:.2f} us; fastest: "
          + ", ".join(f"{name} {med:.2f}" for med, name in ranked[:5]), flush=True)  # fmt: skip
    return results, (shape, floor_us, base, best[1], best[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth(args.iters)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    results, summary = [], []
    for shape in args.shapes.split(","):
        rows, line = bench_shape(shape, args, bandwidth, sms)
        results += rows
        summary.append(line)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tma_gemm.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "args": vars(args), "copy_tb_s": round(bandwidth / 1e12, 3),
         "rows": ROWS, "results": results}, indent=1))  # fmt: skip
    print(f"{'shape':>8} {'floor us':>9} {'cublaslt':>9} {'x floor':>8} {'best TMA config':>26} {'us':>8} "
          f"{'x floor':>8} {'vs lt':>6}")  # fmt: skip
    for shape, floor_us, base, name, med in summary:
        print(f"{shape:>8} {floor_us:>9.2f} {base:>9.2f} {base / floor_us:>8.3f} {name:>26} {med:>8.2f} "
              f"{med / floor_us:>8.3f} {med / base:>6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

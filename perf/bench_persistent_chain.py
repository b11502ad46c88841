"""Does one persistent kernel with grid barriers stream a decode layer's four GEMMs faster than cuBLASLt kernels?

At 64 rows every base GEMM of a decode step takes its weight's bytes at the copy bandwidth plus a fixed ~4 us
(perf/results/2026-12-03-h200/21_cublaslt), 4 GEMMs a layer; with the kernels between them that is where the base
step's time above the floor goes. A persistent kernel (one program an SM) crosses the dependences between the GEMMs
at a grid barrier instead of a kernel boundary, and can ask L2 for its next weight tiles before it waits there.

The chain, ``--layers`` times over distinct weights (more bytes than L2 holds), 64 rows, Llama-3-8B widths:
``q = x Wqkv^T`` (6144 columns) -> ``o = q[:, :4096] Wo^T`` -> ``gu = o Wgu^T`` (28672) -> ``d = (silu(g) * u) Wd^T``
-> the next layer's x. Attention and norms are left out: the question is the GEMMs' boundaries.

* ``cublaslt``: bf16 F.linear per GEMM and the engine's silu * up kernel, in a CUDA graph (the engine's decode path);
* ``persistent``: one launch of ``_chain_kernel``: 132 programs; each GEMM's (column tile, K step) iterations split
  evenly over the programs (stream-K), partial tiles added into fp32 outputs with atomics; a grid barrier between
  GEMMs; silu * up applied as the down GEMM loads its input; the outputs each GEMM adds into are zeroed by an
  earlier GEMM of the chain, so the launch needs no memset;
* ``persistent+pfP``: as ``persistent``, and before each barrier a program asks L2 for the weight tiles of its first
  P iterations of the next GEMM (``prefetch.global.L2``);
* ``nobarrier``: the persistent kernel without its barriers (wrong results): the time of the same weight stream
  with no dependences, the bound of this kernel.

    python3 -m perf.bench_persistent_chain --layers 16 --variants cublaslt,persistent,persistent+pf1,nobarrier
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

ROWS = 64
HIDDEN, QKV, INTER = 4096, 6144, 14336


@triton.jit
def _grid_barrier(bar_ptr, err_ptr, n_programs, BARRIER: tl.constexpr):
    """All programs wait here until every one has arrived. bar_ptr: int32 [2] = (arrived count, generation)."""
    if BARRIER:
        tl.debug_barrier()  # this program's writes are issued before its arrival is
        gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
        arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
        if arrived == n_programs - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
            tl.atomic_add(bar_ptr + 1, 1, sem="release")
        elif tl.atomic_add(err_ptr, 0, sem="relaxed") == 0:  # after a timed-out barrier, none waits again
            cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
            spins = 0
            while (cur == gen) & (spins < 1048576):
                cur = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
                spins += 1
            if cur == gen:
                tl.atomic_xchg(err_ptr, 1)
        tl.debug_barrier()


@triton.jit
def _prefetch_tiles(w_ptr, pid, G, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    ITERS: tl.constexpr, dummy_ptr):  # fmt: skip
    """Ask L2 for the weight tiles of this program's first ITERS iterations of a GEMM (one 128-byte line a lane)."""
    if ITERS > 0:
        KT: tl.constexpr = K // BK
        T: tl.constexpr = (N // BN) * KT
        start = pid * T // G
        LINES: tl.constexpr = BK * 2 // 128  # lines per weight row segment
        lane = tl.arange(0, ITERS * BN * LINES)
        it = tl.minimum(start + lane // (BN * LINES), T - 1)
        col = (it // KT) * BN + (lane // LINES) % BN
        k = (it % KT) * BK + (lane % LINES) * 64
        ptrs = w_ptr + col.to(tl.int64) * K + k
        done = tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        tl.store(dummy_ptr + lane, done, mask=lane < 0)  # never stores: keeps the asm


@triton.jit
def _zero_share(ptr, numel, pid, G, ZB: tl.constexpr):
    """This program's 1/G share of ``numel`` fp32 zeros at ptr."""
    chunk = tl.cdiv(tl.cdiv(numel, G), ZB) * ZB
    lo = pid * chunk
    hi = tl.minimum(lo + chunk, numel)
    for off in range(lo, hi, ZB):
        offs = off + tl.arange(0, ZB)
        tl.store(ptr + offs, tl.zeros((ZB,), tl.float32), mask=offs < hi)


@triton.jit
def _gemm_stage(x_ptr, stride_x, w_ptr, out_ptr, pid, G, N: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, UP_OFFSET: tl.constexpr):  # fmt: skip
    """out[M, N] += x[M, K] @ w[N, K]^T over this program's share of the (column tile, K step) iterations.

    x is fp32 (an earlier stage's output, read past L1: other programs' atomics wrote it); with UP_OFFSET > 0 the
    input is silu(x[:, k]) * x[:, UP_OFFSET + k]. Rounded to w's dtype for the dot, accumulated in fp32, added into out
    with atomics at the end of each tile or of the share.
    """
    KT: tl.constexpr = K // BK
    T: tl.constexpr = (N // BN) * KT
    start = pid * T // G
    end = (pid + 1) * T // G
    offs_m = tl.arange(0, M)
    acc = tl.zeros((M, BN), dtype=tl.float32)
    for it in range(start, end):
        tile = it // KT
        ki = it % KT
        offs_n = tile * BN + tl.arange(0, BN)
        offs_k = ki * BK + tl.arange(0, BK)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None])
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], cache_modifier=".cg")
        if UP_OFFSET > 0:
            up = tl.load(x_ptr + offs_m[:, None] * stride_x + UP_OFFSET + offs_k[None, :], cache_modifier=".cg")
            x = x / (1.0 + tl.exp(-x)) * up
        acc = tl.dot(x.to(w_ptr.dtype.element_ty), w, acc)
        if (ki == KT - 1) | (it == end - 1):
            tl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, sem="relaxed")
            acc = tl.zeros((M, BN), dtype=tl.float32)


@triton.jit
def _chain_kernel(wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, acc_qkv, acc_o, acc_gu, acc_d, bar_ptr, err_ptr, dummy_ptr,
                  n_layers, M: tl.constexpr, HID: tl.constexpr, QKV_N: tl.constexpr, INTER_N: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, BARRIER: tl.constexpr, PREFETCH: tl.constexpr,
                  ZB: tl.constexpr):  # fmt: skip
    """n_layers x [qkv, o, gate/up, down] GEMMs at M rows in one launch of one program an SM.

    acc_d [M, HID] fp32 holds the input and, after, the output; acc_qkv [M, QKV_N] and acc_o [M, HID] fp32 must be
    zero at launch and are zero again after it; acc_gu [M, 2 INTER_N] fp32 is scratch (each stage zeroes a buffer
    that a later stage adds into, after the last read of its previous contents).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for layer in range(n_layers):
        wqkv = wqkv_ptr + tl.cast(layer, tl.int64) * QKV_N * HID
        wo = wo_ptr + tl.cast(layer, tl.int64) * HID * HID
        wgu = wgu_ptr + tl.cast(layer, tl.int64) * 2 * INTER_N * HID
        wd = wd_ptr + tl.cast(layer, tl.int64) * HID * INTER_N
        _gemm_stage(acc_d, HID, wqkv, acc_qkv, pid, G, QKV_N, HID, M, BN, BK, 0)
        _zero_share(acc_gu, M * 2 * INTER_N, pid, G, ZB)
        _prefetch_tiles(wo, pid, G, HID, HID, BN, BK, PREFETCH, dummy_ptr)
        _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
        _gemm_stage(acc_qkv, QKV_N, wo, acc_o, pid, G, HID, HID, M, BN, BK, 0)
        _zero_share(acc_d, M * HID, pid, G, ZB)
        _prefetch_tiles(wgu, pid, G, 2 * INTER_N, HID, BN, BK, PREFETCH, dummy_ptr)
        _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
        _gemm_stage(acc_o, HID, wgu, acc_gu, pid, G, 2 * INTER_N, HID, M, BN, BK, 0)
        _zero_share(acc_qkv, M * QKV_N, pid, G, ZB)
        _prefetch_tiles(wd, pid, G, HID, INTER_N, BN, BK, PREFETCH, dummy_ptr)
        _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
        _gemm_stage(acc_gu, 2 * INTER_N, wd, acc_d, pid, G, HID, INTER_N, M, BN, BK, INTER_N)
        _zero_share(acc_o, M * HID, pid, G, ZB)
        if layer + 1 < n_layers:
            _prefetch_tiles(wqkv + QKV_N * HID, pid, G, QKV_N, HID, BN, BK, PREFETCH, dummy_ptr)
        _grid_barrier(bar_ptr, err_ptr, G, BARRIER)


class Chain:
    """The weights and buffers of one chain, and its launches."""

    def __init__(self, layers: int, device: str, hidden: int = HIDDEN, qkv: int = QKV, inter: int = INTER,
                 rows: int = ROWS, dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
        g = torch.Generator(device=device).manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(layers, n, k, device=device, generator=g) / k**0.5).to(dtype)

        self.dims = (hidden, qkv, inter, rows)
        self.layers = layers
        self.wqkv, self.wo = w(qkv, hidden), w(hidden, hidden)
        self.wgu, self.wd = w(2 * inter, hidden), w(hidden, inter)
        self.x0 = torch.randn(rows, hidden, device=device, generator=g)
        self.acc_qkv = torch.zeros(rows, qkv, device=device)
        self.acc_o = torch.zeros(rows, hidden, device=device)
        self.acc_gu = torch.zeros(rows, 2 * inter, device=device)
        self.acc_d = self.x0.clone()
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.dummy = torch.zeros(1, dtype=torch.int32, device=device)
        # cuBLASLt path: bf16 activations like the engine's
        self.x_bf16 = self.x0.to(dtype)
        self.q = torch.empty(rows, qkv, device=device, dtype=dtype)
        self.o = torch.empty(rows, hidden, device=device, dtype=dtype)
        self.gu = torch.empty(rows, 2 * inter, device=device, dtype=dtype)

    def persistent(self, programs: int, barrier: bool = True, prefetch: int = 0, bn: int = 128, bk: int = 64,
                   num_stages: int = 4, num_warps: int = 4) -> None:  # fmt: skip
        hidden, qkv, inter, rows = self.dims
        _chain_kernel[(programs,)](
            self.wqkv, self.wo, self.wgu, self.wd, self.acc_qkv, self.acc_o, self.acc_gu, self.acc_d, self.bar,
            self.err, self.dummy, self.layers, M=rows, HID=hidden, QKV_N=qkv, INTER_N=inter, BN=bn, BK=bk,
            BARRIER=barrier, PREFETCH=prefetch, ZB=1024, num_stages=num_stages, num_warps=num_warps,
        )  # fmt: skip

    def cublaslt(self) -> None:
        from kernels.silu_mul import silu_mul

        hidden = self.dims[0]
        x = self.x_bf16
        for layer in range(self.layers):
            torch.matmul(x, self.wqkv[layer].t(), out=self.q)
            torch.matmul(self.q[:, :hidden], self.wo[layer].t(), out=self.o)
            torch.matmul(self.o, self.wgu[layer].t(), out=self.gu)
            x = silu_mul(self.gu) @ self.wd[layer].t()
        self.out_bf16 = x

    def reference(self) -> torch.Tensor:
        """fp32 torch of the persistent kernel's numerics: inputs rounded to the weights' dtype before each GEMM."""
        hidden, _, inter, _ = self.dims
        dt = self.wqkv.dtype
        x = self.x0
        for layer in range(self.layers):
            q = x.to(dt).float() @ self.wqkv[layer].float().t()
            o = q[:, :hidden].to(dt).float() @ self.wo[layer].float().t()
            gu = o.to(dt).float() @ self.wgu[layer].float().t()
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            x = h.to(dt).float() @ self.wd[layer].float().t()
        return x


def check(chain: Chain, programs: int, **kw) -> float:
    """Relative max error of one persistent launch against the reference; the scratch buffers must be zero after."""
    chain.acc_d.copy_(chain.x0)
    chain.persistent(programs, **kw)
    torch.cuda.synchronize() if chain.x0.is_cuda else None
    ref = chain.reference()
    err = ((chain.acc_d - ref).abs().max() / ref.abs().max()).item()
    assert int(chain.err.item()) == 0, "a grid barrier timed out"
    for name in ("acc_qkv", "acc_o"):
        assert not getattr(chain, name).any(), f"{name} not zero after the launch"
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default="cublaslt,persistent,persistent+pf1,persistent+pf2,nobarrier")
    ap.add_argument("--configs", default="128x64x4x4,256x64x3x8,64x64x4x4,128x64x3x8",
                    help="persistent tile configs BNxBKxSTAGESxWARPS")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    chain = Chain(args.layers, "cuda")
    small = Chain(2, "cuda")
    floor_bytes = sum(t.numel() * 2 for t in (chain.wqkv, chain.wo, chain.wgu, chain.wd))
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    graphs, checks = {}, []
    for variant in args.variants.split(","):
        for cfg in ([None] if variant == "cublaslt" else args.configs.split(",")):
            kw = {}
            if cfg is not None:
                bn, bk, stages, warps = (int(v) for v in cfg.split("x"))
                kw = {"bn": bn, "bk": bk, "num_stages": stages, "num_warps": warps,
                      "barrier": variant != "nobarrier",
                      "prefetch": int(variant.split("+pf")[1]) if "+pf" in variant else 0}  # fmt: skip
            name = variant if cfg is None else f"{variant}@{cfg}"
            try:
                if cfg is not None and kw["barrier"]:
                    checks.append({"variant": name, "max_rel_err": round(check(small, programs, **kw), 5)})
                    print("check", checks[-1], flush=True)
                    assert checks[-1]["max_rel_err"] < 2e-2, checks[-1]

                def body(kw=kw, cfg=cfg) -> None:
                    if cfg is None:
                        chain.cublaslt()
                    else:
                        chain.persistent(programs, **kw)

                body()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    body()
                graphs[name] = g
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported, not fatal
                print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                checks.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    ref = small.reference()
    small.cublaslt()
    checks.append({"variant": "cublaslt (bf16 activations)", "max_rel_err": round(
        ((small.out_bf16.float() - ref).abs().max() / ref.abs().max()).item(), 5)})  # fmt: skip

    def time_ms(run) -> float:
        for _ in range(2):
            run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / args.iters

    copy_ms = statistics.median(time_ms(lambda: copy_dst.copy_(copy_src)) for _ in range(3))
    bandwidth = 2 * copy_src.numel() / (copy_ms * 1e-3)
    floor_us = floor_bytes / bandwidth * 1e6 / args.layers
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            times.setdefault(name, []).append(time_ms(g.replay) * 1e3 / args.layers)
    assert int(chain.err.item()) == 0, "a grid barrier timed out during the timing"
    base = statistics.median(times["cublaslt"]) if "cublaslt" in times else None
    rows = []
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights' floor {floor_us:.1f} us a layer")
    print(f"{'variant':>28} {'us/layer':>9} {'x floor':>8} {'vs cublaslt':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "us_per_layer": round(med, 2), "rounds": [round(t, 2) for t in ts],
                     "x_floor": round(med / floor_us, 3),
                     "vs_cublaslt": round(med / base, 3) if base else None})  # fmt: skip
        print(f"{name:>28} {med:>9.2f} {med / floor_us:>8.3f} {(med / base if base else float('nan')):>11.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "persistent_chain.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "args": vars(args), "copy_tb_s": round(bandwidth / 1e12, 3),
         "floor_us_per_layer": round(floor_us, 2), "checks": checks, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

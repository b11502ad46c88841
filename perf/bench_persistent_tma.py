"""Can a persistent Triton kernel cross a decode layer's GEMM boundaries for less than cuBLASLt's kernel boundaries?

Every GEMM of a decode step at 64 rows costs its weight's bytes at the copy bandwidth plus a fixed ~4 us, through
cuBLASLt and through a TMA-fed Triton GEMM alike (perf/results/2026-12-04-h200/2_tma_gemm: 0.98-1.03x of cuBLASLt):
the fixed part is the ramp and tail of each launch, not how the tiles are loaded. A persistent kernel (one program
an SM, a grid barrier between dependent GEMMs) can load its first weight tile of the next GEMM before it waits at the
barrier, since the weights do not depend on it; only the activations do. The first persistent chain
(perf/bench_persistent_chain.py: fp32 stream-K tiles) ran 1.48x of cuBLASLt; this one uses the TMA GEMM's configs:

    q   = x Wqkv^T       BN 64,  BK 128, K unsplit: 96 items, bf16 stored
    o   = q[:, :H] Wo^T  BN 64,  BK 128, K split 2: 128 items, fp32 atomics
    gu  = o Wgu^T        BN 256, BK 64,  K unsplit: 112 items, bf16 stored
    d   = (silu(g) u) Wd^T  BN 64, BK 128, K split 2: 128 items, fp32 atomics -> the next layer's x

Weights come through TMA descriptors, activations (written by other programs in the launch) through plain loads
that skip L1. Variants, each a CUDA graph over ``--layers`` layers of distinct weights (more bytes than L2 holds):

* ``cublaslt``: torch matmuls and the engine's silu * up kernel (the decode graphs' base GEMMs);
* ``launches``: the same stage code, one launch per GEMM (no barrier): the body's cost beside cuBLASLt's;
* ``persistent``: one launch for every layer, a grid barrier between GEMMs;
* ``persistent+pre``: as ``persistent``, each program loading its first weight tile of the next GEMM before the
  barrier;
* ``nobarrier``: ``persistent+pre`` without its barriers (wrong results): the bound of this body.

    python3 -m perf.bench_persistent_tma --layers 16
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
from triton.tools.tensor_descriptor import TensorDescriptor

ROWS = 64
HIDDEN, QKV, INTER = 4096, 6144, 14336
# (BN, BK, K split) per GEMM: the fastest TMA configs of 2026-12-04-h200/2_tma_gemm
STAGE_TILES = {"qkv": (64, 128, 1), "o": (64, 128, 2), "gate_up": (256, 64, 1), "down": (64, 128, 2)}


@triton.jit
def _grid_barrier(bar_ptr, err_ptr, n_programs, BARRIER: tl.constexpr):
    """All programs wait here until every one has arrived. bar_ptr: int32 [2] = (arrived count, generation);
    a wait that spins too long sets err_ptr[0] and no later barrier waits."""
    if BARRIER:
        tl.debug_barrier()  # this program's writes are issued before its arrival is
        gen = tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
        arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel")
        if arrived == n_programs - 1:
            tl.atomic_xchg(bar_ptr, 0, sem="relaxed")
            tl.atomic_add(bar_ptr + 1, 1, sem="release")
        elif tl.load(err_ptr, volatile=True) == 0:
            cur = tl.load(bar_ptr + 1, volatile=True)
            spins = 0
            while (cur == gen) & (spins < 4194304):
                cur = tl.load(bar_ptr + 1, volatile=True)
                spins += 1
            if cur == gen:
                tl.atomic_xchg(err_ptr, 1)
            tl.atomic_add(bar_ptr + 1, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _item_coords(item, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """(first weight row, first K column, K columns) of work item ``item`` of a GEMM: (column tile, K split)."""
    KS: tl.constexpr = K // SPLIT
    return (item // SPLIT) * BN, (item % SPLIT) * KS, KS


@triton.jit
def _first_tile(w_desc, layer_row, pid, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SPLIT: tl.constexpr, PRE: tl.constexpr):  # fmt: skip
    """With PRE, the weight tile [BN, BK] of this program's first iteration of a GEMM (a clamped item past the
    last); else zeros, never read."""
    if PRE:
        n_items: tl.constexpr = (N // BN) * SPLIT
        n0, k0, _ = _item_coords(tl.minimum(pid, n_items - 1), N, K, BN, SPLIT)
        tile = w_desc.load([layer_row + n0, k0])
    else:
        tile = tl.zeros((BN, BK), w_desc.dtype)
    return tile


@triton.jit
def _x_tile(x_ptr, stride_x, k, M: tl.constexpr, BK: tl.constexpr, UP_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """Activation tile [M, BK] at column k (silu(x[:, k]) * x[:, UP_OFFSET + k] with UP_OFFSET > 0), read past L1."""
    offs = tl.arange(0, M)[:, None] * stride_x + k + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + offs, cache_modifier=".cg").to(tl.float32)
    if UP_OFFSET > 0:
        up = tl.load(x_ptr + offs + UP_OFFSET, cache_modifier=".cg").to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x.to(dtype)


@triton.jit
def _gemm_item(x_ptr, stride_x, w_desc, layer_row, out_ptr, item, w_pre, N: tl.constexpr, K: tl.constexpr,
               M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, UP_OFFSET: tl.constexpr,
               STAGES: tl.constexpr, USE_PRE: tl.constexpr):  # fmt: skip
    """out[:, tile] (+)= x[:, k range] @ w[tile, k range]^T for one work item; with USE_PRE the first weight tile
    is w_pre, loaded by the caller. SPLIT > 1: fp32 atomics into a zeroed out; else stored in out's dtype."""
    n0, k0, ks = _item_coords(item, N, K, BN, SPLIT)
    dtype = w_desc.dtype
    acc = tl.zeros((M, BN), dtype=tl.float32)
    k_first = k0
    if USE_PRE:
        acc = tl.dot(_x_tile(x_ptr, stride_x, k0, M, BK, UP_OFFSET, dtype), w_pre.T, acc)
        k_first = k0 + BK
    for k in tl.range(k_first, k0 + ks, BK, num_stages=STAGES):
        w = w_desc.load([layer_row + n0, k])
        acc = tl.dot(_x_tile(x_ptr, stride_x, k, M, BK, UP_OFFSET, dtype), w.T, acc)
    ptrs = out_ptr + tl.arange(0, M)[:, None] * N + n0 + tl.arange(0, BN)[None, :]
    if SPLIT > 1:
        tl.atomic_add(ptrs, acc, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _gemm_stage(x_ptr, stride_x, w_desc, layer_row, out_ptr, pid, G, w_pre, N: tl.constexpr, K: tl.constexpr,
                M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, UP_OFFSET: tl.constexpr,
                STAGES: tl.constexpr, PRE: tl.constexpr):  # fmt: skip
    """This program's share (items pid, pid + G, ...) of one GEMM; its first item uses w_pre when PRE."""
    n_items: tl.constexpr = (N // BN) * SPLIT
    if pid < n_items:
        _gemm_item(x_ptr, stride_x, w_desc, layer_row, out_ptr, pid, w_pre, N, K, M, BN, BK, SPLIT, UP_OFFSET,
                   STAGES, PRE)  # fmt: skip
    for item in range(pid + G, n_items, G):
        _gemm_item(x_ptr, stride_x, w_desc, layer_row, out_ptr, item, w_pre, N, K, M, BN, BK, SPLIT, UP_OFFSET,
                   STAGES, False)  # fmt: skip


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
def _chain_kernel(wqkv_desc, wo_desc, wgu_desc, wd_desc, x32, q16, o32, gu16, bar_ptr, err_ptr, first_layer,
                  n_layers, M: tl.constexpr, HID: tl.constexpr, QKV_N: tl.constexpr, INTER_N: tl.constexpr,
                  T_QKV: tl.constexpr, T_O: tl.constexpr, T_GU: tl.constexpr, T_D: tl.constexpr,
                  STAGES: tl.constexpr, BARRIER: tl.constexpr, PRE: tl.constexpr, ONLY: tl.constexpr):  # fmt: skip
    """Layers [first_layer, first_layer + n_layers) of [qkv, o, gate/up, down] GEMMs at M rows.

    x32 [M, HID] fp32: the input, and the output after; q16 [M, QKV_N] and gu16 [M, 2 INTER_N] bf16 scratch; o32
    [M, HID] fp32 must be zero at launch and is zero after. T_*: (BN, BK, SPLIT) per GEMM. ONLY in 0..3 runs just
    that GEMM (one launch per GEMM, no barriers; grid = its items); -1 runs the chain persistently.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for layer in range(first_layer, first_layer + n_layers):
        if (ONLY == -1) | (ONLY == 0):
            w_pre = _first_tile(wqkv_desc, layer * QKV_N, pid, QKV_N, HID, T_QKV[0], T_QKV[1], T_QKV[2], PRE)
            if ONLY == -1:
                _grid_barrier(bar_ptr, err_ptr, G, BARRIER)  # the previous layer's down projection is in x32
            _gemm_stage(x32, HID, wqkv_desc, layer * QKV_N, q16, pid, G, w_pre, QKV_N, HID, M, T_QKV[0], T_QKV[1],
                        T_QKV[2], 0, STAGES, PRE)  # fmt: skip
        if (ONLY == -1) | (ONLY == 1):
            w_pre = _first_tile(wo_desc, layer * HID, pid, HID, HID, T_O[0], T_O[1], T_O[2], PRE)
            if ONLY == -1:
                _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
            _zero_share(x32, M * HID, pid, G, 1024)  # read by the qkv GEMM, added into by the down GEMM
            _gemm_stage(q16, QKV_N, wo_desc, layer * HID, o32, pid, G, w_pre, HID, HID, M, T_O[0], T_O[1], T_O[2],
                        0, STAGES, PRE)  # fmt: skip
        if (ONLY == -1) | (ONLY == 2):
            w_pre = _first_tile(wgu_desc, layer * 2 * INTER_N, pid, 2 * INTER_N, HID, T_GU[0], T_GU[1], T_GU[2], PRE)
            if ONLY == -1:
                _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
            _gemm_stage(o32, HID, wgu_desc, layer * 2 * INTER_N, gu16, pid, G, w_pre, 2 * INTER_N, HID, M, T_GU[0],
                        T_GU[1], T_GU[2], 0, STAGES, PRE)  # fmt: skip
        if (ONLY == -1) | (ONLY == 3):
            w_pre = _first_tile(wd_desc, layer * HID, pid, HID, INTER_N, T_D[0], T_D[1], T_D[2], PRE)
            if ONLY == -1:
                _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
            _zero_share(o32, M * HID, pid, G, 1024)  # read by the gate/up GEMM, added into by the next o GEMM
            _gemm_stage(gu16, 2 * INTER_N, wd_desc, layer * HID, x32, pid, G, w_pre, HID, INTER_N, M, T_D[0],
                        T_D[1], T_D[2], INTER_N, STAGES, PRE)  # fmt: skip


class Chain:
    """The weights, descriptors and buffers of one chain, and its launches."""

    def __init__(self, layers: int, device: str, hidden: int = HIDDEN, qkv: int = QKV, inter: int = INTER,
                 rows: int = ROWS, dtype: torch.dtype = torch.bfloat16, tiles: dict | None = None) -> None:  # fmt: skip
        g = torch.Generator(device=device).manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(layers, n, k, device=device, generator=g) / k**0.5).to(dtype)

        self.dims = (hidden, qkv, inter, rows)
        self.layers = layers
        self.tiles = tiles or STAGE_TILES
        self.wqkv, self.wo = w(qkv, hidden), w(hidden, hidden)
        self.wgu, self.wd = w(2 * inter, hidden), w(hidden, inter)
        t = self.tiles

        def desc(weights: torch.Tensor, name: str) -> TensorDescriptor:
            flat = weights.reshape(-1, weights.shape[-1])
            return TensorDescriptor.from_tensor(flat, [t[name][0], t[name][1]])

        self.descs = (desc(self.wqkv, "qkv"), desc(self.wo, "o"), desc(self.wgu, "gate_up"), desc(self.wd, "down"))
        self.x0 = torch.randn(rows, hidden, device=device, generator=g)
        self.x32 = self.x0.clone()
        self.q16 = torch.zeros(rows, qkv, device=device, dtype=dtype)
        self.o32 = torch.zeros(rows, hidden, device=device)
        self.gu16 = torch.zeros(rows, 2 * inter, device=device, dtype=dtype)
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        # cuBLASLt path: bf16 activations like the engine's
        self.x_bf16 = self.x0.to(dtype)
        self.q = torch.empty(rows, qkv, device=device, dtype=dtype)
        self.o = torch.empty(rows, hidden, device=device, dtype=dtype)
        self.gu = torch.empty(rows, 2 * inter, device=device, dtype=dtype)

    def _launch(self, grid: int, first: int, count: int, stages: int, barrier: bool, pre: bool, only: int) -> None:
        hidden, qkv, inter, rows = self.dims
        t = self.tiles
        _chain_kernel[(grid,)](
            *self.descs, self.x32, self.q16, self.o32, self.gu16, self.bar, self.err, first, count, M=rows,
            HID=hidden, QKV_N=qkv, INTER_N=inter, T_QKV=t["qkv"], T_O=t["o"], T_GU=t["gate_up"], T_D=t["down"],
            STAGES=stages, BARRIER=barrier, PRE=pre, ONLY=only, num_warps=4,
        )  # fmt: skip

    def persistent(self, programs: int, stages: int = 4, barrier: bool = True, pre: bool = True) -> None:
        """Every layer in one launch of ``programs`` programs (x32 reset to the input first)."""
        self.x32.copy_(self.x0)
        self._launch(programs, 0, self.layers, stages, barrier, pre, -1)

    def launches(self, stages: int = 4) -> None:
        """The same stages, one launch per GEMM with one program per work item (x32 reset to the input first)."""
        hidden, qkv, inter, _ = self.dims
        widths = {"qkv": qkv, "o": hidden, "gate_up": 2 * inter, "down": hidden}
        self.x32.copy_(self.x0)
        for layer in range(self.layers):
            for only, name in enumerate(("qkv", "o", "gate_up", "down")):
                bn, _, split = self.tiles[name]
                self._launch(widths[name] // bn * split, layer, 1, stages, False, False, only)

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
        """fp32 torch of the kernel's numerics: each GEMM's input rounded to the weights' dtype."""
        hidden, _, inter, _ = self.dims
        dt = self.wqkv.dtype
        x = self.x0
        for layer in range(self.layers):
            q = (x.to(dt).float() @ self.wqkv[layer].float().t()).to(dt)
            o = q[:, :hidden].float() @ self.wo[layer].float().t()
            gu = (o.to(dt).float() @ self.wgu[layer].float().t()).to(dt).float()
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            x = h.to(dt).float() @ self.wd[layer].float().t()
        return x


def check(chain: Chain, run) -> float:
    """Relative error of one run against the reference; o32 must be zero after it and no barrier timed out."""
    chain.x32.fill_(float("nan"))
    chain.q16.fill_(float("nan"))
    chain.gu16.fill_(float("nan"))
    run()
    if chain.x0.is_cuda:
        torch.cuda.synchronize()
    ref = chain.reference()
    assert int(chain.err.item()) == 0, "a grid barrier timed out"
    assert not chain.o32.any(), "o32 not zero after the launch"
    return ((chain.x32 - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default="cublaslt,launches,persistent,persistent+pre,nobarrier")
    ap.add_argument("--stages", default="4,3", help="software-pipelining depths to try")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    chain = Chain(args.layers, "cuda")
    small = Chain(2, "cuda")
    floor_bytes = sum(t.numel() * 2 for t in (chain.wqkv, chain.wo, chain.wgu, chain.wd))
    graphs, checks = {}, []
    for variant in args.variants.split(","):
        for stages in [None] if variant == "cublaslt" else [int(s) for s in args.stages.split(",")]:
            name = variant if stages is None else f"{variant}@{stages}"

            def body(c: Chain, variant=variant, stages=stages) -> None:
                if variant == "cublaslt":
                    c.cublaslt()
                elif variant == "launches":
                    c.launches(stages)
                else:
                    c.persistent(programs, stages, barrier=variant != "nobarrier", pre=variant != "persistent")

            try:
                if variant not in ("cublaslt", "nobarrier"):
                    errs = [round(check(small, lambda: body(small)), 5) for _ in range(2)]
                    checks.append({"variant": name, "rel_err": errs})
                    print("check", checks[-1], flush=True)
                    assert max(errs) < 2e-2, checks[-1]
                body(chain)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    body(chain)
                graphs[name] = g
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile or fit is reported, not fatal
                print(f"{name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                checks.append({"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
    ref = small.reference()
    small.cublaslt()
    checks.append({"variant": "cublaslt (bf16 activations)", "rel_err": round(
        ((small.out_bf16.float() - ref).norm() / ref.norm()).item(), 5)})  # fmt: skip

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

    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
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
    print(f"{'variant':>20} {'us/layer':>9} {'x floor':>8} {'vs cublaslt':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "us_per_layer": round(med, 2), "rounds": [round(t, 2) for t in ts],
                     "x_floor": round(med / floor_us, 3),
                     "vs_cublaslt": round(med / base, 3) if base else None})  # fmt: skip
        print(f"{name:>20} {med:>9.2f} {med / floor_us:>8.3f} {(med / base if base else float('nan')):>11.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "persistent_tma.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "args": vars(args), "tiles": STAGE_TILES,
         "copy_tb_s": round(bandwidth / 1e12, 3), "floor_us_per_layer": round(floor_us, 2), "checks": checks,
         "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

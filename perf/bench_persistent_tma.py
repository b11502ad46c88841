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
def _proxy_fence(dummy_ptr, FENCE: tl.constexpr):
    """Every thread: order the generic-proxy writes it has seen before this thread's later TMA (async-proxy) reads
    of global memory (``fence.proxy.async.global``); nothing with FENCE False (the CPU interpreter)."""
    if FENCE:
        lane = tl.arange(0, 128)
        done = tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r,r", [lane],
                                         dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        tl.store(dummy_ptr + lane, done, mask=lane < 0)  # never stores: keeps the asm


@triton.jit
def _item_coords(item, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """(first weight row, first K column, K columns) of work item ``item`` of a GEMM: (column tile, K split)."""
    KS: tl.constexpr = K // SPLIT
    return (item // SPLIT) * BN, (item % SPLIT) * KS, KS


@triton.jit
def _first_tile(w_desc, layer_row, pid, N: tl.constexpr, K: tl.constexpr, T: tl.constexpr, PRE: tl.constexpr):
    """With PRE, the weight tile [BN, BK] of this program's first iteration of a GEMM (a clamped item past the
    last); else zeros, never read. T = (BN, BK, SPLIT)."""
    BN: tl.constexpr = T[0]
    BK: tl.constexpr = T[1]
    if PRE:
        n_items: tl.constexpr = (N // BN) * T[2]
        n0, k0, _ = _item_coords(tl.minimum(pid, n_items - 1), N, K, BN, T[2])
        tile = w_desc.load([layer_row + n0, k0])
    else:
        tile = tl.zeros((BN, BK), w_desc.dtype)
    return tile


@triton.jit
def _x_tile(x_desc, k, UP_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """Activation tile [M, BK] at column k through TMA (silu(x[:, k]) * x[:, UP_OFFSET + k] with UP_OFFSET > 0)."""
    x = x_desc.load([0, k]).to(tl.float32)
    if UP_OFFSET > 0:
        up = x_desc.load([0, UP_OFFSET + k]).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    return x.to(dtype)


@triton.jit
def _gemm_item(x_desc, w_desc, layer_row, out_ptr, item, w_pre, N: tl.constexpr, K: tl.constexpr, M: tl.constexpr,
               T: tl.constexpr, UP_OFFSET: tl.constexpr, STAGES: tl.constexpr, USE_PRE: tl.constexpr):  # fmt: skip
    """out[:, tile] (+)= x[:, k range] @ w[tile, k range]^T for one work item; with USE_PRE the first weight tile
    is w_pre, loaded by the caller. SPLIT > 1: fp32 atomics into a zeroed out; else stored in out's dtype."""
    BN: tl.constexpr = T[0]
    BK: tl.constexpr = T[1]
    n0, k0, ks = _item_coords(item, N, K, BN, T[2])
    dtype = w_desc.dtype
    acc = tl.zeros((M, BN), dtype=tl.float32)
    k_first = k0
    if USE_PRE:
        acc = tl.dot(_x_tile(x_desc, k0, UP_OFFSET, dtype), w_pre.T, acc)
        k_first = k0 + BK
    for k in tl.range(k_first, k0 + ks, BK, num_stages=STAGES):
        w = w_desc.load([layer_row + n0, k])
        acc = tl.dot(_x_tile(x_desc, k, UP_OFFSET, dtype), w.T, acc)
    ptrs = out_ptr + tl.arange(0, M)[:, None] * N + n0 + tl.arange(0, BN)[None, :]
    if T[2] > 1:
        tl.atomic_add(ptrs, acc, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _gemm_stage(x_desc, w_desc, layer_row, out_ptr, pid, G, w_pre, N: tl.constexpr, K: tl.constexpr,
                M: tl.constexpr, T: tl.constexpr, UP_OFFSET: tl.constexpr, STAGES: tl.constexpr,
                PRE: tl.constexpr):  # fmt: skip
    """This program's share (items pid, pid + G, ...) of one GEMM; its first item uses w_pre when PRE."""
    n_items: tl.constexpr = (N // T[0]) * T[2]
    if pid < n_items:
        _gemm_item(x_desc, w_desc, layer_row, out_ptr, pid, w_pre, N, K, M, T, UP_OFFSET, STAGES, PRE)
    for item in range(pid + G, n_items, G):
        _gemm_item(x_desc, w_desc, layer_row, out_ptr, item, w_pre, N, K, M, T, UP_OFFSET, STAGES, False)


@triton.jit
def _zero_share(ptr, numel, pid, G, SPLIT: tl.constexpr):
    """With SPLIT > 1 (an fp32 output that the GEMM adds into), this program's 1/G share of ``numel`` zeros."""
    if SPLIT > 1:
        ZB: tl.constexpr = 1024
        chunk = tl.cdiv(tl.cdiv(numel, G), ZB) * ZB
        lo = pid * chunk
        hi = tl.minimum(lo + chunk, numel)
        for off in range(lo, hi, ZB):
            offs = off + tl.arange(0, ZB)
            tl.store(ptr + offs, tl.zeros((ZB,), tl.float32), mask=offs < hi)


@triton.jit
def _sync(bar_ptr, err_ptr, dummy_ptr, G, ONLY: tl.constexpr, BARRIER: tl.constexpr, FENCE: tl.constexpr):
    """Between two GEMMs of the persistent chain: the grid barrier, then the proxy fence for the TMA reads of what
    other programs wrote. Nothing when each GEMM is its own launch."""
    if ONLY == -1:
        _proxy_fence(dummy_ptr, FENCE)
        _grid_barrier(bar_ptr, err_ptr, G, BARRIER)
        _proxy_fence(dummy_ptr, FENCE)


@triton.jit
def _chain_kernel(wq_desc, wo_desc, wgu_desc, wd_desc, xd_desc, xq_desc, xo_desc, xgu_desc, d_ptr, q_ptr, o_ptr,
                  gu_ptr, bar_ptr, err_ptr, dummy_ptr, first_layer, n_layers, M: tl.constexpr, HID: tl.constexpr,
                  QKV_N: tl.constexpr, INTER_N: tl.constexpr, T_Q: tl.constexpr, T_O: tl.constexpr,
                  T_GU: tl.constexpr, T_D: tl.constexpr, STAGES: tl.constexpr, BARRIER: tl.constexpr,
                  PRE: tl.constexpr, ONLY: tl.constexpr, FENCE: tl.constexpr):  # fmt: skip
    """Layers [first_layer, first_layer + n_layers) of [qkv, o, gate/up, down] GEMMs at M rows.

    Buffers d (the input, and the output after), q, o, gu, each read by the next GEMM through its descriptor x*_desc;
    a GEMM with T[2] (its K split) > 1 adds fp32 partial sums into its zeroed buffer, else stores bf16. The buffer of
    GEMM s is zeroed during GEMM s + 2 (after the barrier behind its reader), so o and q must be zero at launch
    when split. T_* = (BN, BK, SPLIT). ONLY in 0..3 runs just that GEMM (one launch per GEMM, no barriers; grid =
    its items); -1 runs the chain persistently.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    for layer in range(first_layer, first_layer + n_layers):
        if (ONLY == -1) | (ONLY == 0):
            w_pre = _first_tile(wq_desc, layer * QKV_N, pid, QKV_N, HID, T_Q, PRE)
            _sync(bar_ptr, err_ptr, dummy_ptr, G, ONLY, BARRIER, FENCE)  # the previous layer's down is in d
            _zero_share(gu_ptr, M * 2 * INTER_N, pid, G, T_GU[2])
            _gemm_stage(xd_desc, wq_desc, layer * QKV_N, q_ptr, pid, G, w_pre, QKV_N, HID, M, T_Q, 0, STAGES, PRE)
        if (ONLY == -1) | (ONLY == 1):
            w_pre = _first_tile(wo_desc, layer * HID, pid, HID, HID, T_O, PRE)
            _sync(bar_ptr, err_ptr, dummy_ptr, G, ONLY, BARRIER, FENCE)
            _zero_share(d_ptr, M * HID, pid, G, T_D[2])
            _gemm_stage(xq_desc, wo_desc, layer * HID, o_ptr, pid, G, w_pre, HID, HID, M, T_O, 0, STAGES, PRE)
        if (ONLY == -1) | (ONLY == 2):
            w_pre = _first_tile(wgu_desc, layer * 2 * INTER_N, pid, 2 * INTER_N, HID, T_GU, PRE)
            _sync(bar_ptr, err_ptr, dummy_ptr, G, ONLY, BARRIER, FENCE)
            _zero_share(q_ptr, M * QKV_N, pid, G, T_Q[2])
            _gemm_stage(xo_desc, wgu_desc, layer * 2 * INTER_N, gu_ptr, pid, G, w_pre, 2 * INTER_N, HID, M, T_GU, 0,
                        STAGES, PRE)  # fmt: skip
        if (ONLY == -1) | (ONLY == 3):
            w_pre = _first_tile(wd_desc, layer * HID, pid, HID, INTER_N, T_D, PRE)
            _sync(bar_ptr, err_ptr, dummy_ptr, G, ONLY, BARRIER, FENCE)
            _zero_share(o_ptr, M * HID, pid, G, T_O[2])
            _gemm_stage(xgu_desc, wd_desc, layer * HID, d_ptr, pid, G, w_pre, HID, INTER_N, M, T_D, INTER_N, STAGES,
                        PRE)  # fmt: skip


TILE_SETS = {
    # the TMA GEMM's fastest configs: o and down split K in two, adding fp32 partial sums
    "split": STAGE_TILES,
    # every GEMM stored in bf16 (no atomics, no zeroing): o and down in 32-column tiles to keep 128 programs
    "bf16": {"qkv": (64, 128, 1), "o": (32, 128, 1), "gate_up": (256, 64, 1), "down": (32, 128, 1)},
    # every GEMM stored in bf16 in the TMA GEMM's tiles: o and down on 64 programs
    "bf16_64": {"qkv": (64, 128, 1), "o": (64, 128, 1), "gate_up": (256, 64, 1), "down": (64, 128, 1)},
}
GEMMS = ("qkv", "o", "gate_up", "down")


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
        t = self.tiles
        self.wqkv, self.wo = w(qkv, hidden), w(hidden, hidden)
        self.wgu, self.wd = w(2 * inter, hidden), w(hidden, inter)
        self.x0 = torch.randn(rows, hidden, device=device, generator=g)
        widths = {"qkv": qkv, "o": hidden, "gate_up": 2 * inter, "down": hidden}
        # each GEMM's output: fp32 (zeroed) when it splits K, else the weights' dtype
        self.bufs = {n: torch.zeros(rows, widths[n], device=device, dtype=torch.float32 if t[n][2] > 1 else dtype)
                     for n in GEMMS}  # fmt: skip
        self.widths = widths

        def desc(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
            return TensorDescriptor.from_tensor(x.reshape(-1, x.shape[-1]), block)

        weights = (self.wqkv, self.wo, self.wgu, self.wd)
        self.w_descs = [desc(wt, [t[n][0], t[n][1]]) for wt, n in zip(weights, GEMMS, strict=True)]
        # the input of each GEMM is the previous one's buffer (qkv's: down's, the previous layer's output)
        self.x_descs = [desc(self.bufs[GEMMS[i - 1]], [rows, t[GEMMS[i]][1]]) for i in range(4)]
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.dummy = torch.zeros(128, dtype=torch.int32, device=device)
        self.fence = device != "cpu"
        self.compiled: dict[str, dict] = {}
        # cuBLASLt path: bf16 activations like the engine's
        self.x_bf16 = self.x0.to(dtype)
        self.q = torch.empty(rows, qkv, device=device, dtype=dtype)
        self.o = torch.empty(rows, hidden, device=device, dtype=dtype)
        self.gu = torch.empty(rows, 2 * inter, device=device, dtype=dtype)

    @property
    def out(self) -> torch.Tensor:
        return self.bufs["down"]

    def _launch(self, grid: int, first: int, count: int, stages: int, barrier: bool, pre: bool, only: int) -> None:
        hidden, qkv, inter, rows = self.dims
        t = self.tiles
        b = self.bufs
        kernel = _chain_kernel[(grid,)](
            *self.w_descs, *self.x_descs, b["down"], b["qkv"], b["o"], b["gate_up"], self.bar, self.err, self.dummy,
            first, count, M=rows, HID=hidden, QKV_N=qkv, INTER_N=inter, T_Q=t["qkv"], T_O=t["o"],
            T_GU=t["gate_up"], T_D=t["down"], STAGES=stages, BARRIER=barrier, PRE=pre, ONLY=only, FENCE=self.fence,
            num_warps=4,
        )  # fmt: skip
        key = f"only={only} stages={stages} pre={pre} barrier={barrier}"
        if key not in self.compiled and hasattr(kernel, "n_regs"):
            self.compiled[key] = {"regs": kernel.n_regs, "spills": kernel.n_spills,
                                  "shared": getattr(kernel.metadata, "shared", None)}  # fmt: skip

    def persistent(self, programs: int, stages: int = 4, barrier: bool = True, pre: bool = True) -> None:
        """Every layer in one launch of ``programs`` programs (the input copied in first)."""
        self.out.copy_(self.x0)
        self._launch(programs, 0, self.layers, stages, barrier, pre, -1)

    def launches(self, stages: int = 4) -> None:
        """The same GEMMs, one launch each with one program per work item (the input copied in first)."""
        self.out.copy_(self.x0)
        for layer in range(self.layers):
            for only, name in enumerate(GEMMS):
                bn, _, split = self.tiles[name]
                self._launch(self.widths[name] // bn * split, layer, 1, stages, False, False, only)

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
            q = x.to(dt).float() @ self.wqkv[layer].float().t()
            o = q[:, :hidden].to(dt).float() @ self.wo[layer].float().t()
            gu = (o.to(dt).float() @ self.wgu[layer].float().t()).to(self.bufs["gate_up"].dtype).float()
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            x = h.to(dt).float() @ self.wd[layer].float().t()
        return x


def check(chain: Chain, run) -> float:
    """Relative error of one run against the reference; the buffers that are stored are poisoned first, the fp32
    ones of o and q (zeroed by later GEMMs) must be zero after, and no barrier may have timed out."""
    for name, buf in chain.bufs.items():
        if chain.tiles[name][2] == 1:
            buf.fill_(float("nan"))
    run()
    if chain.x0.is_cuda:
        torch.cuda.synchronize()
    ref = chain.reference()
    assert int(chain.err.item()) == 0, "a grid barrier timed out"
    for name in ("qkv", "o"):
        assert chain.tiles[name][2] == 1 or not chain.bufs[name].any(), f"{name} buffer not zero after the launch"
    return ((chain.out.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default="launches,persistent,persistent+pre,nobarrier")
    ap.add_argument("--tile-sets", default=",".join(TILE_SETS))
    ap.add_argument("--stages", default="4,3", help="software-pipelining depths to try")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    chains = {ts: Chain(args.layers, "cuda", tiles=TILE_SETS[ts]) for ts in args.tile_sets.split(",")}
    smalls = {ts: Chain(2, "cuda", tiles=TILE_SETS[ts]) for ts in chains}
    any_chain = next(iter(chains.values()))
    floor_bytes = sum(t.numel() * 2 for t in (any_chain.wqkv, any_chain.wo, any_chain.wgu, any_chain.wd))
    graphs, checks = {}, []
    plan = [("cublaslt", None, None)] + [(v, ts, int(st)) for ts in chains for v in args.variants.split(",")
                                         for st in args.stages.split(",")]  # fmt: skip
    for variant, ts, stages in plan:
        name = variant if ts is None else f"{variant}[{ts}]@{stages}"

        def body(c: Chain, variant: str = variant, stages: int | None = stages) -> None:
            if variant == "cublaslt":
                c.cublaslt()
            elif variant == "launches":
                c.launches(stages)
            else:
                c.persistent(programs, stages, barrier=variant != "nobarrier", pre=variant != "persistent")

        chain = any_chain if ts is None else chains[ts]
        try:
            if variant not in ("cublaslt", "nobarrier"):
                small = smalls[ts]
                errs = [round(check(small, lambda small=small: body(small)), 5) for _ in range(2)]
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
            msg = f"{type(exc).__name__}: {str(exc)[-700:]}"
            print(f"{name}: {msg}", flush=True)
            checks.append({"variant": name, "error": msg})
    small = next(iter(smalls.values()))
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
    for chain in chains.values():
        assert int(chain.err.item()) == 0, "a grid barrier timed out during the timing"
    base = statistics.median(times["cublaslt"]) if "cublaslt" in times else None
    rows = []
    compiled = {ts: c.compiled for ts, c in chains.items()}
    print("compiled:", json.dumps(compiled))
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights' floor {floor_us:.1f} us a layer")
    print(f"{'variant':>28} {'us/layer':>9} {'x floor':>8} {'vs cublaslt':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "us_per_layer": round(med, 2), "rounds": [round(t, 2) for t in ts],
                     "x_floor": round(med / floor_us, 3),
                     "vs_cublaslt": round(med / base, 3) if base else None})  # fmt: skip
        print(f"{name:>28} {med:>9.2f} {med / floor_us:>8.3f} {(med / base if base else float('nan')):>11.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "persistent_tma.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "args": vars(args), "tiles": {ts: TILE_SETS[ts] for ts in chains},
         "copy_tb_s": round(bandwidth / 1e12, 3), "floor_us_per_layer": round(floor_us, 2), "checks": checks,
         "compiled": compiled, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

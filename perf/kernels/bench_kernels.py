"""GPU timings of the LoRA shrink/expand and paged-attention kernels (not a test).

    python -m perf.kernels.bench_kernels [--out PATH] [--quick] [--sweep]

Llama-3-8B projections (bf16) for batches of 1..256 tokens over 1..64 distinct adapters at
ranks 8/16/64, in three launch forms: BGMV ("decode": no segments, what the CUDA-graph decode
step launches by default), SGMV ("prefill": tokens grouped by slot on the host) and SGMV over
fixed-shape tables built on the device (what a CUDA-graph decode step launches with
``decode_lora_kernels="sgmv"``). Each kernel is timed with
``triton.testing.do_bench_cudagraph`` (median) and reported against the bytes it must move:

* shrink: the distinct adapters' A rows + x + the fp32 output (read and written);
* expand: the distinct adapters' B rows + y + the base output (read and written);

as GB/s and as a multiple of the bytes floor (those bytes at the device-to-device copy
bandwidth measured at the start of the run). The S-LoRA "bmm" baseline gathers each token's A
(B) into a contiguous [T, r, in] ([T, r, out]) tensor with ``index_select`` and runs ``bmm``
(and adds into the output), per slice; its time and our speed-up are on the same line.

To keep the L2 cache (50 MB) from holding the adapters across repetitions, every timed call
uses the next of several random choices of adapters out of a universe of ~256 MB of them.
Full results go to ``--out`` as JSON lines (default ``$OUT/bench_kernels.jsonl`` when OUT is
set); a compact table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from functools import partial

import torch
import triton
import triton.testing

from manylora.kernels.lora_config import bgmv_tile_expand_config, expand_config, shrink_config
from manylora.kernels.lora_expand import lora_expand
from manylora.kernels.lora_meta import build_segments, build_segments_on_device, sgmv_block_m
from manylora.kernels.lora_shrink import lora_shrink
from manylora.kernels.paged_attention import paged_decode_attention

MODULES = {  # name: (in_features, widths of the slices sharing the input)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
BATCHES = (1, 16, 64, 256)
DISTINCT = (1, 8, 16, 64)
RANKS = (8, 16, 64)
L2_BYTES = 50 * 2**20
UNIVERSE_BYTES = 256 * 2**20
DTYPE = torch.bfloat16
REP_MS = 10

RESULTS: list[dict] = []


def bench(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph."""
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median") * 1e3


def cycling(calls):
    """One callable that runs the next of ``calls`` each time (captured into the graph in turn)."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    nbytes = 2 * 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(partial(dst.copy_, src), rep=200, return_mode="median") * 1e-3
    return 2 * nbytes / t


class Universe:
    """Adapters of one projection group and rank, laid out in one flat pool (A and B^T rows)."""

    def __init__(self, in_features: int, widths: tuple[int, ...], rank: int, min_adapters: int) -> None:
        ns = len(widths)
        per_adapter = rank * (ns * in_features + sum(widths)) * 2
        self.count = max(min_adapters, min(2048, math.ceil(UNIVERSE_BYTES / per_adapter)))
        u, r = self.count, rank
        sizes = [u * r * in_features] * ns + [u * r * w for w in widths]
        self.pool = torch.randn(sum(sizes), dtype=DTYPE, device="cuda") * 0.02
        self.wa, self.wb, a_offs, b_offs = [], [], [], []
        base = 0
        rows = torch.arange(u * r, device="cuda", dtype=torch.int64).view(u, r)
        for i in range(ns):  # A_i as [U, r, in]: row (u, k) at base + (u * r + k) * in
            self.wa.append(self.pool[base : base + sizes[i]].view(u, r, in_features))
            a_offs.append(base + rows * in_features)
            base += sizes[i]
        for i, w in enumerate(widths):  # B_i^T as [U, r, w]
            self.wb.append(self.pool[base : base + sizes[ns + i]].view(u, r, w))
            b_offs.append(base + rows * w)
            base += sizes[ns + i]
        self.a_offs = torch.stack(a_offs)  # [NS, U, r]
        self.b_offs = torch.stack(b_offs)


class Batch:
    """One random choice of ``distinct`` adapters of a universe for ``num_tokens`` tokens."""

    def __init__(self, uni: Universe, num_tokens: int, distinct: int, gen: torch.Generator) -> None:
        chosen = torch.randperm(uni.count, generator=gen)[:distinct].cuda()
        slots = (torch.arange(num_tokens) % distinct)[torch.randperm(num_tokens, generator=gen)].to(torch.int32)
        self.a_offs = uni.a_offs[:, chosen].contiguous()
        self.b_offs = uni.b_offs[:, chosen].contiguous()
        self.slots = slots.cuda()
        self.index = chosen[slots.cuda().long()]  # adapter of each token, for the bmm baseline
        self.segments = build_segments(slots, device="cuda")
        # what a CUDA-graph decode step with decode_lora_kernels="sgmv" launches: fixed-shape tables built on the
        # device (once per step, shared by every layer: built here, outside the timed calls)
        self.device_segments = build_segments_on_device(self.slots, distinct)
        self.device_segments.tiles(sgmv_block_m(self.device_segments.max_seg_len))


def bench_lora(name, in_f, widths, rank, num_tokens, distinct, uni, copy_bw, forms, gen):
    ns = len(widths)
    bounds = [0]
    for w in widths:
        bounds.append(bounds[-1] + w)
    adapter_a = distinct * ns * rank * in_f * 2
    adapter_b = distinct * rank * sum(widths) * 2
    nsets = max(1, min(256, math.ceil(3 * L2_BYTES / (adapter_a + adapter_b))))
    batches = [Batch(uni, num_tokens, distinct, gen) for _ in range(nsets)]
    ranks = torch.full((ns, distinct), rank, dtype=torch.int32, device="cuda")
    scal = torch.full((ns, distinct), 0.5, device="cuda")
    x = torch.randn(num_tokens, in_f, dtype=DTYPE, device="cuda")
    y = torch.zeros(ns, num_tokens, rank, device="cuda")
    base = torch.zeros(num_tokens, bounds[-1], dtype=DTYPE, device="cuda")
    bytes_shrink = adapter_a + x.numel() * 2 + 2 * y.numel() * 4
    bytes_expand = adapter_b + y.numel() * 4 + 2 * base.numel() * 2

    def bmm_shrink(b):
        for i in range(ns):
            a = uni.wa[i].index_select(0, b.index)  # [T, r, in]
            y[i] = torch.bmm(x.unsqueeze(1), a.transpose(1, 2)).squeeze(1)

    def bmm_expand(b):
        for i in range(ns):
            bt = uni.wb[i].index_select(0, b.index)  # [T, r, w]
            base[:, bounds[i] : bounds[i + 1]] += torch.bmm(y[i].to(DTYPE).unsqueeze(1), bt).squeeze(1)

    t_bmm = {
        "shrink": bench(cycling([partial(bmm_shrink, b) for b in batches])),
        "expand": bench(cycling([partial(bmm_expand, b) for b in batches])),
    }
    def segments_of(b: Batch, form: str):
        return {"bgmv": None, "sgmv": b.segments, "sgmv-device": b.device_segments}[form]

    for form in forms:
        if form == "sgmv" and num_tokens == 1:
            continue
        calls = {
            "shrink": [
                partial(lora_shrink, x, uni.pool, b.a_offs, ranks, b.slots, y, segments=segments_of(b, form))
                for b in batches
            ],
            "expand": [
                partial(lora_expand, y, uni.pool, b.b_offs, ranks, scal, b.slots, base, bounds,
                        segments=segments_of(b, form))
                for b in batches
            ],
        }  # fmt: skip
        for op in ("shrink", "expand"):
            us = bench(cycling(calls[op]))
            nbytes = bytes_shrink if op == "shrink" else bytes_expand
            floor_us = nbytes / copy_bw * 1e6
            seg = segments_of(batches[0], form)
            if op == "shrink":
                cfg = shrink_config(num_tokens, in_f, rank, seg is not None, seg.max_seg_len if seg else 0, ns,
                                    seg.config_segments() if seg else 0)  # fmt: skip
            else:
                cfg = expand_config(num_tokens, max(widths), rank, seg is not None, seg.max_seg_len if seg else 0, ns)
            rec = {
                "kind": "lora", "module": name, "op": op, "form": form, "tokens": num_tokens,
                "distinct": distinct, "rank": rank, "in": in_f, "widths": list(widths), "us": us,
                "bytes": nbytes, "gbps": nbytes / us * 1e-3, "floor_us": floor_us, "x_floor": us / floor_us,
                "bmm_us": t_bmm[op], "speedup_vs_bmm": t_bmm[op] / us, "config": cfg, "sets": nsets,
            }  # fmt: skip
            RESULTS.append(rec)
            print(
                f"  {name:7s} {op:6s} {form} T={num_tokens:4d} d={distinct:2d} r={rank:2d}: {us:8.2f} us "
                f"{rec['gbps']:7.0f} GB/s {rec['x_floor']:6.2f}x floor | bmm {t_bmm[op]:8.2f} us "
                f"x{rec['speedup_vs_bmm']:5.1f}",
                flush=True,
            )


def sweep(copy_bw, gen, modules=("qkv",)):
    """Shrink BGMV configs around the heuristic, per module at rank 16 (tuning aid): BLOCK_K x SPLIT_K at 4 warps,
    and 2 / 8 warps at the heuristic's BLOCK_K."""
    rank = 16
    print("BGMV shrink sweep (rank 16): the heuristic's choice and the best configs", flush=True)
    for name in modules:
        in_f, widths = MODULES[name]
        ns = len(widths)
        uni = Universe(in_f, widths, rank, 64)
        for num_tokens, distinct in ((1, 1), (16, 16), (64, 64), (256, 64)):
            nsets = max(1, min(64, math.ceil(3 * L2_BYTES / (distinct * ns * rank * in_f * 2))))
            batches = [Batch(uni, num_tokens, distinct, gen) for _ in range(nsets)]
            ranks = torch.full((ns, distinct), rank, dtype=torch.int32, device="cuda")
            x = torch.randn(num_tokens, in_f, dtype=DTYPE, device="cuda")
            y = torch.zeros(ns, num_tokens, rank, device="cuda")
            nbytes = distinct * ns * rank * in_f * 2 + x.numel() * 2 + 2 * y.numel() * 4
            floor_us = nbytes / copy_bw * 1e6
            heur = shrink_config(num_tokens, in_f, rank, False, num_slices=ns)

            def time_of(cfg, x=x, y=y, ranks=ranks, batches=batches, pool=uni.pool):
                return bench(cycling([partial(lora_shrink, x, pool, b.a_offs, ranks, b.slots, y, config=cfg)
                                      for b in batches]))  # fmt: skip

            t_heur = time_of(heur)
            results = []
            for block_k, split, warps in itertools.product((128, 256, 512), (1, 2, 4, 8, 16, 32), (2, 4, 8)):
                if split > in_f // block_k or (warps != 4 and block_k != heur["BLOCK_K"]):
                    continue
                cfg = {"BLOCK_R": 16, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": warps}
                results.append((time_of(cfg), cfg))
            results.sort(key=lambda r: r[0])
            RESULTS.append({"kind": "shrink_sweep", "module": name, "tokens": num_tokens, "distinct": distinct,
                            "floor_us": floor_us, "heuristic_us": t_heur, "heuristic_config": heur,
                            "tried": [{"us": us, "config": c} for us, c in results]})  # fmt: skip
            best = ", ".join(f"{us:.2f} us K{c['BLOCK_K']}/s{c['SPLIT_K']}/{c['num_warps']}w" for us, c in results[:3])
            print(f"  {name:7s} T={num_tokens:3d} d={distinct:2d}: floor {floor_us:6.2f} us | heuristic {t_heur:7.2f} "
                  f"({t_heur / floor_us:4.2f}x, K{heur['BLOCK_K']}/s{heur['SPLIT_K']}) | best {best}", flush=True)
        del uni
        torch.cuda.empty_cache()


def sweep_expand(copy_bw, gen, modules):
    """BGMV expand at rank 16: the tile body (``bgmv_tile_expand_config``), the launcher's heuristic, and the
    row-streaming body over BLOCK_N x num_warps, per module and (tokens, distinct adapters)."""
    rank = 16
    print("BGMV expand sweep (rank 16): tile body, the heuristic's choice, best row-body configs", flush=True)
    for name in modules:
        in_f, widths = MODULES[name]
        ns, bounds = len(widths), [0]
        for w in widths:
            bounds.append(bounds[-1] + w)
        uni = Universe(in_f, widths, rank, 64)
        for num_tokens, distinct in ((1, 1), (16, 16), (64, 8), (64, 64), (256, 64)):
            nsets = max(1, min(64, math.ceil(3 * L2_BYTES / (distinct * rank * sum(widths) * 2))))
            batches = [Batch(uni, num_tokens, distinct, gen) for _ in range(nsets)]
            ranks = torch.full((ns, distinct), rank, dtype=torch.int32, device="cuda")
            scal = torch.full((ns, distinct), 0.5, device="cuda")
            y = torch.randn(ns, num_tokens, rank, device="cuda")
            base = torch.zeros(num_tokens, bounds[-1], dtype=DTYPE, device="cuda")
            nbytes = distinct * rank * sum(widths) * 2 + y.numel() * 4 + 2 * base.numel() * 2
            floor_us = nbytes / copy_bw * 1e6

            def time_of(cfg, pool=uni.pool, batches=batches, args=(ranks, scal), y=y, base=base, bounds=bounds):
                calls = [partial(lora_expand, y, pool, b.b_offs, *args, b.slots, base, bounds, config=cfg)
                         for b in batches]  # fmt: skip
                return bench(cycling(calls))

            heur = expand_config(num_tokens, max(widths), rank, False, num_slices=ns)
            tile_cfg = bgmv_tile_expand_config(num_tokens, max(widths), rank, ns)
            t_tile, t_rows = time_of(tile_cfg), time_of(heur)
            tried = []
            for block_n, warps in itertools.product((256, 512, 1024, 2048), (1, 2, 4, 8)):
                if block_n // warps < 64 or block_n // warps > 1024:
                    continue
                cfg = {"ROWS": True, "BLOCK_R": 16, "BLOCK_N": block_n, "num_warps": warps}
                tried.append((time_of(cfg), cfg))
            tried.sort(key=lambda r: r[0])
            RESULTS.append({"kind": "expand_sweep", "module": name, "tokens": num_tokens, "distinct": distinct,
                            "floor_us": floor_us, "tile_us": t_tile, "tile_config": tile_cfg,
                            "heuristic_us": t_rows, "heuristic_config": heur,
                            "tried": [{"us": us, "config": c} for us, c in tried]})  # fmt: skip
            best = ", ".join(f"{us:.2f} us {c['BLOCK_N']}/{c['num_warps']}w" for us, c in tried[:3])
            print(f"  {name:7s} T={num_tokens:3d} d={distinct:2d}: floor {floor_us:6.2f} us | tile {t_tile:7.2f} "
                  f"({t_tile / floor_us:4.2f}x) | heuristic {t_rows:7.2f} ({t_rows / floor_us:4.2f}x, "
                  f"{'rows' if heur['ROWS'] else 'tile'} {heur['BLOCK_N']}/{heur['num_warps']}w) | best rows {best}",
                  flush=True)
        del uni
        torch.cuda.empty_cache()


def bench_attention():
    print("paged decode attention, 32 heads / 8 kv heads, d=128, page 16, 32 layers, bf16", flush=True)
    num_layers, page, nkv, group, d = 32, 16, 8, 4, 128
    for batch, seq in [(1, 1024), (64, 512), (64, 4096), (256, 1024)]:
        pages_per = seq // page
        num_pages = batch * pages_per
        page_elems = num_layers * 2 * page * nkv * d
        pool = torch.randn(num_pages * page_elems, dtype=DTYPE, device="cuda")
        bt = torch.randperm(num_pages, device="cuda", dtype=torch.int64).to(torch.int32).view(batch, pages_per)
        lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, nkv * group, d, dtype=DTYPE, device="cuda")
        out = torch.empty_like(q)

        def attn(q=q, pool=pool, bt=bt, lens=lens, out=out):
            paged_decode_attention(q, pool, bt, lens, d**-0.5, out, layer=5, num_layers=num_layers,
                                   page_size=page, num_kv_heads=nkv)  # fmt: skip

        us = bench(attn)
        kv_bytes = batch * seq * 2 * nkv * d * 2
        RESULTS.append({"kind": "attention", "batch": batch, "seq": seq, "us": us, "gbps": kv_bytes / us * 1e-3})
        print(f"  B={batch:4d} seq={seq:5d}: {us:7.1f} us graph ({kv_bytes / us * 1e-3:7.0f} GB/s)", flush=True)
        del pool


def print_table(form: str = "bgmv"):
    rows = [r for r in RESULTS if r["kind"] == "lora" and r["form"] == form]
    if not rows:
        return
    print(f"\n{form} summary: us / multiple of the bytes floor / speed-up over bmm")
    print(f"{'module':8s} {'T':>4s} {'d':>3s} {'r':>3s} | {'shrink us':>9s} {'xflr':>5s} {'vs bmm':>6s} |"
          f" {'expand us':>9s} {'xflr':>5s} {'vs bmm':>6s}")  # fmt: skip
    by_key = {(r["module"], r["tokens"], r["distinct"], r["rank"], r["op"]): r for r in rows}
    for (mod, t, d, rank, op), s in by_key.items():
        if op != "shrink":
            continue
        e = by_key.get((mod, t, d, rank, "expand"))
        line = f"{mod:8s} {t:4d} {d:3d} {rank:3d} | {s['us']:9.2f} {s['x_floor']:5.2f} {s['speedup_vs_bmm']:6.1f} |"
        if e:
            line += f" {e['us']:9.2f} {e['x_floor']:5.2f} {e['speedup_vs_bmm']:6.1f}"
        print(line)


def main():
    global REP_MS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "bench_kernels.jsonl") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out, help="JSON lines output (default $OUT/bench_kernels.jsonl)")
    parser.add_argument("--quick", action="store_true", help="rank 16 only, BGMV only (unless --forms)")
    parser.add_argument("--forms", default=None,
                        help="comma-separated launch forms: bgmv (one program per token), sgmv (host-built segments), "
                             "sgmv-device (fixed-shape segments built on the device, as a CUDA-graph decode step "
                             "with decode_lora_kernels=sgmv launches); default bgmv,sgmv,sgmv-device")
    parser.add_argument("--sweep", action="store_true", help="also sweep BGMV shrink configs (on --modules)")
    parser.add_argument("--sweep-expand", action="store_true",
                        help="BGMV expand: old tile body against the row-streaming one, and the row form's configs")
    parser.add_argument("--sweep-only", action="store_true", help="run the requested sweeps only")
    parser.add_argument("--modules", default=",".join(MODULES), help="comma-separated subset of " + ",".join(MODULES))
    parser.add_argument("--rep-ms", type=int, default=REP_MS, help="do_bench_cudagraph rep (ms)")
    parser.add_argument("--tokens", default=",".join(map(str, BATCHES)),
                        help="comma-separated batch sizes (tokens) of the LoRA launches")
    parser.add_argument("--no-attention", action="store_true", help="skip the paged-attention timings")
    args = parser.parse_args()
    REP_MS = args.rep_ms
    start = time.time()
    gen = torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth()
    RESULTS.append({"kind": "copy", "bytes_per_s": copy_bw})
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s", flush=True)
    if args.sweep:
        sweep(copy_bw, gen, args.modules.split(","))
    if args.sweep_expand:
        sweep_expand(copy_bw, gen, args.modules.split(","))
    if args.sweep_only:
        if args.out:
            with open(args.out, "w") as f:
                f.writelines(json.dumps(rec) + "\n" for rec in RESULTS)
        return
    ranks = (16,) if args.quick else RANKS
    forms = tuple(args.forms.split(",")) if args.forms else ("bgmv",) if args.quick else ("bgmv", "sgmv", "sgmv-device")
    for name in args.modules.split(","):
        in_f, widths = MODULES[name]
        for rank in ranks:
            print(f"LoRA {name}: in={in_f} out={'+'.join(map(str, widths))} rank={rank}", flush=True)
            uni = Universe(in_f, widths, rank, max(DISTINCT))
            for num_tokens in map(int, args.tokens.split(",")):
                for distinct in DISTINCT:
                    if distinct <= num_tokens:
                        bench_lora(name, in_f, widths, rank, num_tokens, distinct, uni, copy_bw, forms, gen)
            del uni
            torch.cuda.empty_cache()
    if not args.no_attention:
        bench_attention()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            for rec in RESULTS:
                f.write(json.dumps(rec) + "\n")
    for form in forms:
        print_table(form)
    print(f"\n{time.time() - start:.0f} s; results: {args.out}")


if __name__ == "__main__":
    main()

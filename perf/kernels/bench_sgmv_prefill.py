"""GPU timings of the segmented (SGMV, prefill) LoRA kernels at prefill sizes, against the base GEMM.

    PYTHONPATH=. python perf/kernels/bench_sgmv_prefill.py --out $OUT/sgmv.json
    PYTHONPATH=/tmp/old:. python perf/kernels/bench_sgmv_prefill.py --out $OUT/sgmv_old.json  # an older kernels/
    python perf/kernels/bench_sgmv_prefill.py --compare $OUT/sgmv_old.json $OUT/sgmv.json

One Llama-3-8B layer's four LoRA groups (q/k/v, o, gate/up, down; bf16, rank 16) for prefill steps
of T tokens: sequences of random lengths (8..512, S-LoRA's range) laid end to end, each sequence's
adapter drawn from ``distinct`` adapters, so segments are as uneven as a real step's. Timed per
group with ``triton.testing.do_bench_cudagraph`` (median): shrink + expand together, and the base
projection (``x @ W^T`` into the same output) that the LoRA rides on. Printed per case: LoRA us,
base GEMM us, LoRA / base, and the multiple of the bytes floor (x, the output read and written,
the adapters' rows, at the copy bandwidth measured in the same run). ``--sweep`` also times a few
block configurations of each kernel at T=4096 and reports the fastest.

``manylora.kernels`` is imported from the first entry of ``sys.path`` that has it, so the same script
times a previous commit's kernels (a copy of its ``manylora/kernels/`` put first on PYTHONPATH);
``--compare`` prints the two runs side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from functools import partial

import torch
import triton
import triton.testing

GROUPS = {  # name: (in_features, widths of the slices sharing the input)
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
TOKENS = (512, 2048, 4096)
DISTINCT = (1, 8, 32)
RANK = 16
DTYPE = torch.bfloat16


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(partial(dst.copy_, src), rep=100, return_mode="median") * 1e-3)


def step_slots(num_tokens: int, distinct: int, rng: random.Random) -> torch.Tensor:
    """int32 [T]: sequences of 8..512 tokens end to end, each with one of ``distinct`` adapters."""
    slots: list[int] = []
    while len(slots) < num_tokens:
        slots += [rng.randrange(distinct)] * rng.randint(8, 512)
    return torch.tensor(slots[:num_tokens], dtype=torch.int32)


class Case:
    def __init__(self, group: str, num_tokens: int, distinct: int, seed: int) -> None:
        from manylora.kernels.lora_meta import build_segments

        in_f, widths = GROUPS[group]
        self.in_f, self.widths, self.ns = in_f, widths, len(widths)
        self.bounds = [0]
        for w in widths:
            self.bounds.append(self.bounds[-1] + w)
        g = torch.Generator(device="cuda").manual_seed(seed)
        per = RANK * (self.ns * in_f + sum(widths))
        self.pool = torch.randn(distinct * per, dtype=DTYPE, device="cuda", generator=g) * 0.02
        rows = torch.arange(distinct * RANK, device="cuda", dtype=torch.int64).view(distinct, RANK)
        a_offs, b_offs, at = [], [], 0
        for _ in range(self.ns):
            a_offs.append(at + rows * in_f)
            at += distinct * RANK * in_f
        for w in widths:
            b_offs.append(at + rows * w)
            at += distinct * RANK * w
        self.a_offs, self.b_offs = torch.stack(a_offs), torch.stack(b_offs)
        self.ranks = torch.full((self.ns, distinct), RANK, dtype=torch.int32, device="cuda")
        self.scalings = torch.full((self.ns, distinct), 0.5, device="cuda")
        slots = step_slots(num_tokens, distinct, random.Random(seed))
        self.slots = slots.cuda()
        self.segments = build_segments(slots, device="cuda")
        self.x = torch.randn(num_tokens, in_f, dtype=DTYPE, device="cuda", generator=g)
        self.w = torch.randn(self.bounds[-1], in_f, dtype=DTYPE, device="cuda", generator=g) * 0.02
        self.y = torch.empty(self.ns, num_tokens, RANK, device="cuda")
        self.out = torch.zeros(num_tokens, self.bounds[-1], dtype=DTYPE, device="cuda")
        self.floor_bytes = (self.x.numel() * 2 + 2 * self.out.numel() * 2 + 2 * self.y.numel() * 4
                            + distinct * per * 2)

    def lora(self, shrink_cfg=None, expand_cfg=None) -> None:
        from manylora.kernels.lora_expand import lora_expand
        from manylora.kernels.lora_shrink import lora_shrink

        lora_shrink(self.x, self.pool, self.a_offs, self.ranks, self.slots, self.y, segments=self.segments,
                    config=shrink_cfg)
        lora_expand(self.y, self.pool, self.b_offs, self.ranks, self.scalings, self.slots, self.out, self.bounds,
                    segments=self.segments, config=expand_cfg)

    def base(self) -> None:
        torch.matmul(self.x, self.w.t(), out=self.out)


SHRINK_SWEEP = [*(dict(BLOCK_M=m, BLOCK_R=16, BLOCK_K=k, num_warps=4) for m in (32, 64, 128) for k in (64, 128)),
                dict(BLOCK_M=64, BLOCK_R=16, BLOCK_K=128, num_warps=8)]
EXPAND_SWEEP = [dict(BLOCK_M=m, BLOCK_R=16, BLOCK_N=n, num_warps=w) for m in (32, 64) for n in (64, 128, 256)
                for w in (4, 8)]
SWEEP_GROUPS = ("qkv", "gate_up")


def run(out_path: str, sweep: bool) -> None:
    import manylora.kernels
    import manylora.kernels.lora_meta

    bw = copy_bandwidth()
    rows = []
    for group in GROUPS:
        for t in TOKENS:
            for d in DISTINCT:
                case = Case(group, t, d, seed=zlib.crc32(f"{group}/{t}/{d}".encode()))
                lora_us, base_us = bench(case.lora), bench(case.base)
                rows.append(dict(group=group, tokens=t, distinct=d, segments=case.segments.num_segments,
                                 lora_us=lora_us, base_us=base_us, floor_us=case.floor_bytes / bw * 1e6))
                r = rows[-1]
                print(f"{group:8s} T={t:5d} d={d:3d} ({r['segments']:3d} segs): LoRA {lora_us:8.1f} us, base GEMM "
                      f"{base_us:8.1f} us, LoRA/base {lora_us / base_us:5.2f}, {lora_us / r['floor_us']:5.2f}x floor",
                      flush=True)
    swept = []
    if sweep and not hasattr(manylora.kernels.lora_meta.SegmentMeta, "tiles"):
        print("no sweep: these kernels predate the tile tables")
    elif sweep:
        for group in SWEEP_GROUPS:
            case = Case(group, 4096, 8, seed=7)
            from manylora.kernels.lora_config import shrink_config

            for block_m in (32, 64, 128):  # tile tables built before the graph capture
                case.segments.tiles(block_m)

            for cfg in SHRINK_SWEEP:
                try:
                    us = bench(partial(case.lora, shrink_cfg={**cfg, "SPLIT_K": 1}))
                except Exception as e:  # noqa: BLE001 - a config the kernel cannot take (registers, shared memory)
                    us = float("nan")
                    print(f"   shrink {cfg}: {type(e).__name__}")
                swept.append(dict(group=group, kernel="shrink+default expand", cfg=cfg, us=us))
            for cfg in EXPAND_SWEEP:
                try:
                    us = bench(partial(case.lora, expand_cfg=cfg))
                except Exception as e:  # noqa: BLE001
                    us = float("nan")
                    print(f"   expand {cfg}: {type(e).__name__}")
                swept.append(dict(group=group, kernel="default shrink+expand", cfg=cfg, us=us))
            default = bench(case.lora)
            print(f"== sweep {group} T=4096 d=8: default {default:.1f} us; default shrink config "
                  f"{shrink_config(4096, case.in_f, RANK, True, case.segments.max_seg_len, case.ns, 8)}")
            for kind in ("shrink+default expand", "default shrink+expand"):
                best = sorted((s for s in swept if s["group"] == group and s["kernel"] == kind and s["us"] == s["us"]),
                              key=lambda s: s["us"])[:3]
                for s in best:
                    print(f"   {kind}: {s['us']:.1f} us with {s['cfg']}")
    with open(out_path, "w") as f:
        json.dump(dict(kernels=manylora.kernels.__file__, copy_bandwidth=bw, rows=rows, sweep=swept), f)


def compare(old_path: str, new_path: str) -> None:
    from pathlib import Path

    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    print(f"old kernels: {old['kernels']}\nnew kernels: {new['kernels']}")
    print("| group | T | distinct | old LoRA us | new LoRA us | speed-up | new LoRA / base GEMM | new x floor |")
    print("|---|---|---|---|---|---|---|---|")
    keyed = {(r["group"], r["tokens"], r["distinct"]): r for r in old["rows"]}
    for r in new["rows"]:
        o = keyed.get((r["group"], r["tokens"], r["distinct"]))
        if o is None:
            continue
        print(f"| {r['group']} | {r['tokens']} | {r['distinct']} | {o['lora_us']:.1f} | {r['lora_us']:.1f} | "
              f"{o['lora_us'] / r['lora_us']:.2f}x | {r['lora_us'] / r['base_us']:.3f} | "
              f"{r['lora_us'] / r['floor_us']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/sgmv.json")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    a = p.parse_args()
    if a.compare:
        compare(*a.compare)
    else:
        run(a.out, a.sweep)


if __name__ == "__main__":
    main()

"""Does prefetching a base GEMM's first weight bytes into L2, during the short kernel before it, shorten the GEMM?

For each Llama-3-8B projection (q/k/v, o, gate/up, down) at decode rows, a CUDA graph chains ``--layers`` distinct
weights (more bytes than L2 holds), each as the decode step runs it: a short kernel producing the GEMM's input (add +
RMSNorm, or silu * up before down), then the GEMM (cuBLASLt, as the decode graphs take it). Variants add, on a side
stream forked just before the short kernel, a prefetch of part of that weight (``kernels/l2_prefetch.py``):

* ``kfirst:MB``: the first columns (K) of every row, MB megabytes in all (a GEMM walking K from 0 in every tile);
* ``head:MB``: the first rows whole (tiles walking the output columns in order).

Timed as CUDA-graph replays in interleaved rounds; per GEMM (with its short kernel) in microseconds, and the ratio
to the variant without prefetch in the same process.

    python3 -m perf.bench_prefetch --variants none,kfirst:8,kfirst:16,head:16 --forms line,bulk
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def region(spec: str, n: int, k: int, elem: int) -> dict[str, int]:
    """prefetch_l2 keyword arguments for a ``pattern:MB`` spec on an [n, k] weight."""
    pattern, mb = spec.split(":")
    want = int(float(mb) * (1 << 20))
    if pattern == "kfirst":
        return {"cols": max(64, min(k, want // (n * elem)))}
    if pattern == "head":
        return {"rows": max(1, min(n, want // (k * elem)))}
    raise ValueError(f"unknown prefetch pattern {pattern!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--variants", default="none,kfirst:8,kfirst:16,kfirst:32,head:16")
    ap.add_argument("--forms", default="line,bulk")
    ap.add_argument("--blas", default="cublaslt")
    ap.add_argument(
        "--when",
        choices=["window", "previous"],
        default="window",
        help="the prefetch forked before the GEMM's short input kernel (window), or for the next "
        "weight when the previous GEMM starts (previous: it overlaps that GEMM's tail)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "perf/results"))
    args = ap.parse_args()

    from kernels.add_rms_norm import add_rms_norm
    from kernels.l2_prefetch import prefetch_l2
    from kernels.silu_mul import silu_mul

    torch.backends.cuda.preferred_blas_library(args.blas)
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    forms = args.forms.split(",")
    variants = [("none", "-")] + [(v, f) for v in args.variants.split(",") if v != "none" for f in forms]
    graphs = {}
    keep = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(args.layers)]
        if shape == "down":  # silu * up before the down projection
            src = torch.randn(args.rows, 2 * k, device=dev, dtype=dtype)
            make_input = functools.partial(silu_mul, src)
        else:  # add + RMSNorm before the others (attention before o_proj is longer)
            h = torch.randn(args.rows, k, device=dev, dtype=dtype)
            norm_w = torch.ones(k, device=dev, dtype=dtype)
            make_input = functools.partial(lambda h, w: add_rms_norm(h, None, w, 1e-5)[0], h, norm_w)
        keep.append(weights)
        for spec, form in variants:

            def body(spec=spec, form=form, weights=weights, make_input=make_input, n=n, k=k):
                outs = []
                main = torch.cuda.current_stream()
                for j, w in enumerate(weights):
                    if spec != "none" and args.when == "window":
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            prefetch_l2(w, how=form, **region(spec, n, k, w.element_size()))
                    x = make_input()
                    if spec != "none" and args.when == "previous" and j + 1 < len(weights):
                        side.wait_stream(main)  # from the start of this GEMM, for the next weight
                        with torch.cuda.stream(side):
                            nxt = weights[j + 1]
                            prefetch_l2(nxt, how=form, **region(spec, n, k, nxt.element_size()))
                    outs.append(F.linear(x, w))
                if spec != "none":
                    main.wait_stream(side)
                return outs

            for _ in range(2):
                body()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            graphs[(shape, spec, form)] = g
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
    rows = []
    for (shape, spec, form), ts in times.items():
        med = statistics.median(ts)
        base = statistics.median(times[(shape, "none", "-")])
        rows.append(
            {
                "shape": shape,
                "prefetch": spec,
                "form": form,
                "us": round(med, 2),
                "rounds": [round(t, 2) for t in ts],
                "vs_none": round(med / base, 3),
            }
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefetch.json").write_text(
        json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, indent=1)
    )
    print(f"{'shape':>8} {'prefetch':>11} {'form':>5} {'us/gemm':>8} {'vs none':>8}")
    for r in rows:
        print(f"{r['shape']:>8} {r['prefetch']:>11} {r['form']:>5} {r['us']:>8.2f} {r['vs_none']:>8.3f}")


if __name__ == "__main__":
    main()

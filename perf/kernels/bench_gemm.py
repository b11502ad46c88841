"""The base layers' GEMMs at decode batch sizes: manylora/kernels/skinny_gemm.py against F.linear (cuBLAS) (not a test).

    python -m perf.kernels.bench_gemm [--rows 1,16,64,128] [--sweep] [--rep-ms 5] [--out PATH]
        [--blas cublas|cublaslt] [--sm-carveout N]

A model's projections (``--shape``, default Llama-3-8B: q/k/v fused, o, gate/up fused, down) and LM head in bf16,
x of ``rows`` tokens. Each GEMM is timed with ``triton.testing.do_bench_cudagraph`` (median), cycling over enough
copies of the weight (>= 256 MB) that the L2 cache (50 MB) cannot hold it between repetitions, and reported against
its bytes floor (weight + x + output at the device-to-device copy bandwidth measured at the start of the run).
``--sweep`` also times a grid of block sizes, K splits and pipeline depths at each (shape, rows) and prints the best
against the launcher's heuristic (``manylora.kernels.skinny_gemm.gemm_config``); every config's time goes to the
record's
``sweep`` list, fastest first. Results go to ``--out`` as JSON lines
(default ``$OUT/bench_gemm.jsonl`` when OUT is set); a table is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from manylora.engine.model_config import ModelConfig
from manylora.kernels.skinny_gemm import gemm_config, skinny_linear
from perf.engine.shapes import SHAPES
from perf.kernels.bench_kernels import copy_bandwidth, cycling


def gemm_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each GEMM a decode step runs per layer (fused as the model fuses them), and the
    LM head's."""
    def out(module: str) -> int:
        return cfg.projection_shape(module)[1]

    return {
        "qkv": (out("q_proj") + out("k_proj") + out("v_proj"), cfg.hidden_size),
        "o": (cfg.hidden_size, cfg.projection_shape("o_proj")[0]),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
    }


UNIVERSE_BYTES = 256 * 2**20
DTYPE = torch.bfloat16
SWEEP = {"BLOCK_N": (32, 64, 128), "BLOCK_K": (64, 128, 256), "SPLIT_K": (1, 2, 4, 8), "num_stages": (3, 5)}


def bench_us(fn, rep_ms: int) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph (one eager call first: the kernel's workspace and
    compilation stay out of the capture)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def weights(out_features: int, in_features: int) -> list[torch.Tensor]:
    nbytes = out_features * in_features * 2
    copies = max(1, -(-UNIVERSE_BYTES // nbytes))
    return [torch.randn(out_features, in_features, device="cuda", dtype=DTYPE) * in_features**-0.5
            for _ in range(copies)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "bench_gemm.jsonl") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--rows", default="1,16,64,128")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                        help="the model (perf/engine/shapes.py)")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head", help="the GEMMs, a comma-separated subset")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs (see SWEEP)")
    parser.add_argument("--rep-ms", type=int, default=5)
    parser.add_argument("--blas", choices=["cublas", "cublaslt"], default="cublas",
                        help="the cuBLAS interface F.linear takes (torch.backends.cuda.preferred_blas_library)")
    parser.add_argument("--sm-carveout", type=int, default=None,
                        help="SMs cuBLAS leaves free (torch's experimental SM carveout); default none")
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    torch._C._set_sm_carveout_experimental(args.sm_carveout)
    start = time.time()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; F.linear: "
          f"{args.blas}, SM carveout {args.sm_carveout}")
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s", flush=True)
    records: list[dict] = [{"kind": "copy", "bytes_per_s": copy_bw, "shape": args.shape, "blas": args.blas,
                            "sm_carveout": args.sm_carveout}]
    shapes = gemm_shapes(ModelConfig.from_dict(SHAPES[args.shape]))
    for name in args.shapes.split(","):
        out_f, in_f = shapes[name]
        ws = weights(out_f, in_f)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f, device="cuda", dtype=DTYPE)
            floor_us = (out_f * in_f + rows * in_f + rows * out_f) * 2 / copy_bw * 1e6
            # the two agree before either is timed
            torch.testing.assert_close(skinny_linear(x, ws[0]).float(), F.linear(x, ws[0]).float(), rtol=2e-2,
                                       atol=2e-2)
            cublas = bench_us(cycling([lambda w=w, x=x: F.linear(x, w) for w in ws]), args.rep_ms)
            triton_us = bench_us(cycling([lambda w=w, x=x: skinny_linear(x, w) for w in ws]), args.rep_ms)
            rec = {"kind": "gemm", "shape": name, "rows": rows, "out": out_f, "in": in_f,
                   "config": gemm_config(rows, out_f, in_f), "floor_us": round(floor_us, 2),
                   "cublas_us": round(cublas, 2), "triton_us": round(triton_us, 2),
                   "cublas_x_floor": round(cublas / floor_us, 3), "triton_x_floor": round(triton_us / floor_us, 3),
                   "speedup_vs_cublas": round(cublas / triton_us, 3)}  # fmt: skip
            if args.sweep:
                timed = []
                for values in itertools.product(*SWEEP.values()):
                    cfg = {**gemm_config(rows, out_f, in_f), **dict(zip(SWEEP, values, strict=True))}
                    try:
                        us = bench_us(cycling([lambda w=w, x=x, cfg=cfg: skinny_linear(x, w, config=cfg) for w in ws]),
                                      args.rep_ms)
                    except Exception as exc:  # a config the compiler refuses (shared memory) is skipped
                        print(f"  {name} {rows} {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    timed.append((us, cfg))
                best_us, best_cfg = min(timed, key=lambda t: t[0])
                rec.update(best_us=round(best_us, 2), best_config=best_cfg,
                           heuristic_over_best=round(triton_us / best_us, 3),
                           sweep=[{**cfg, "us": round(us, 2)} for us, cfg in sorted(timed, key=lambda t: t[0])])
            records.append(rec)
            print(json.dumps(rec), flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"\n{'shape':8s} {'rows':>4s} {'floor us':>8s} | {'cuBLAS us':>9s} {'xflr':>5s} | {'triton us':>9s}"
          f" {'xflr':>5s} {'vs cuBLAS':>9s}" + (f" | {'best us':>8s} {'heur/best':>9s}" if args.sweep else ""))
    for r in records[1:]:
        line = (f"{r['shape']:8s} {r['rows']:4d} {r['floor_us']:8.2f} | {r['cublas_us']:9.2f}"
                f" {r['cublas_x_floor']:5.2f} | {r['triton_us']:9.2f} {r['triton_x_floor']:5.2f}"
                f" {r['speedup_vs_cublas']:9.2f}")
        if "best_us" in r:
            line += f" | {r['best_us']:8.2f} {r['heuristic_over_best']:9.2f}"
        print(line)
    print(f"\n{time.time() - start:.0f} s; results: {args.out}")


if __name__ == "__main__":
    main()

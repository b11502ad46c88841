"""Probe (2026-12-03, run from the repository root on the H200): does torch's TunableOp tune cuBLASLt algorithms on
this CUDA build, and what would the decode GEMMs (Llama-3-8B projections, 64 rows) gain?"""

import os

import torch
import torch.cuda.tunable as tunable
import torch.nn.functional as F
import triton.testing

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    print(torch.__version__, torch.version.cuda, flush=True)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    x = {k: torch.randn(64, v[1], device="cuda", dtype=torch.bfloat16) for k, v in SHAPES.items()}
    copies = {k: max(2, (512 << 20) // (n * kk * 2)) for k, (n, kk) in SHAPES.items()}  # more than L2 holds
    weights = {
        k: [torch.randn(v, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies[k])]
        for k, v in SHAPES.items()
    }

    def time_us(k: str) -> float:
        def calls():
            for w in weights[k]:
                F.linear(x[k], w)

        return triton.testing.do_bench_cudagraph(calls, rep=200, return_mode="median") * 1e3 / len(weights[k])

    base = {k: time_us(k) for k in SHAPES}
    print("default cublaslt:", {k: round(v, 2) for k, v in base.items()}, flush=True)
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_iterations(100)
    tunable.set_max_tuning_duration(200)
    tunable.set_filename(os.path.join(os.environ.get("OUT", "/tmp"), "tunableop_results.csv"))
    for k in SHAPES:
        F.linear(x[k], weights[k][0])
    torch.cuda.synchronize()
    print("results:", tunable.get_results(), flush=True)
    tunable.tuning_enable(False)
    tuned = {k: time_us(k) for k in SHAPES}
    print("tuned:", {k: round(v, 2) for k, v in tuned.items()})
    print("ratio tuned/default:", {k: round(tuned[k] / base[k], 3) for k in SHAPES})


if __name__ == "__main__":
    main()

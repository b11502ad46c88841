"""Plot achieved GB/s against distinct adapters from perf/kernels/bench_kernels.py's JSON lines.

    R=perf/results/2026-11-29-h200
    python -m perf.kernels.plot_kernels $R/bench_kernels.jsonl --out $R \
        --expand-jsonl $R/bench_kernels_run1_expand_final.jsonl

One panel per projection group (qkv, o, gate_up, down) for the decode (BGMV) form at rank 16,
a line per batch size, and the measured copy bandwidth as the ceiling.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--out", default=".")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--expand-jsonl", help="take the expand rows from this file instead (another run)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines() if line.strip()]
    ceiling = next(r["bytes_per_s"] for r in rows if r["kind"] == "copy") / 1e9
    if args.expand_jsonl:
        other = [json.loads(line) for line in Path(args.expand_jsonl).read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("op") != "expand"] + [r for r in other if r.get("op") == "expand"]
    lora = [r for r in rows if r["kind"] == "lora" and r["form"] == "bgmv" and r["rank"] == args.rank]
    modules = sorted({r["module"] for r in lora})
    fig, axes = plt.subplots(2, len(modules), figsize=(4 * len(modules), 7), sharey=True, squeeze=False)
    for row, op in enumerate(("shrink", "expand")):
        for col, module in enumerate(modules):
            ax = axes[row][col]
            for tokens in sorted({r["tokens"] for r in lora}):
                pts = sorted((r["distinct"], r["gbps"]) for r in lora
                             if r["module"] == module and r["op"] == op and r["tokens"] == tokens)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{tokens} tokens")
            ax.axhline(ceiling, color="gray", linestyle="--", label=f"copy {ceiling:.0f} GB/s")
            ax.axhline(0.7 * ceiling, color="gray", linestyle=":", label="70% of copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {module}, rank {args.rank}")
            ax.set_xlabel("distinct adapters")
            if col == 0:
                ax.set_ylabel("achieved GB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("LoRA kernels, decode form (BGMV), NVIDIA H200, bf16, CUDA-graph medians")
    fig.tight_layout()
    out = Path(args.out) / "lora_kernels_gbps.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()

"""Prefill attention of an eager step: every sequence alone (the old loop) vs grouped calls.

    python -m perf.kernels.bench_prefill_attention --device cpu --seqs 1 4 8 16 --chunk 16 64

For each number of prefill sequences in the step (chunks of --chunk tokens at random context
lengths up to --max-context), over --layers layers of the Llama-3-8B attention shape (32 heads, 8
KV heads, head_dim 128): the ATen ops dispatched per layer (each a kernel launch on a GPU) and the
wall time of all layers (CUDA: synchronized). Tables built once per step are counted in the step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from manylora.engine.layers.prefill_attention import attend, attend_each, build_groups
from manylora.engine.layers.step_batch import SequenceSlice


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def make_step(rng: random.Random, seqs: int, chunk: int, max_context: int, page_size: int, layers: int,
              device: str, dtype: torch.dtype):
    heads, kv_heads, d = 32, 8, 128
    blocks = -(-max_context // page_size)
    storage = torch.randn(seqs * blocks + 1, layers, 2, page_size, kv_heads, d, device=device, dtype=dtype)
    sequences, positions, row = [], [], 0
    for i in range(seqs):
        context = rng.randint(chunk, max_context)
        table = torch.arange(i * blocks, i * blocks + -(-context // page_size), device=device)
        sequences.append(SequenceSlice(row, chunk, context, table))
        positions += range(context - chunk, context)
        row += chunk
    q = torch.randn(row, heads, d, device=device, dtype=dtype)
    return storage, sequences, torch.tensor(positions, device=device), q


def run(mode: str, storage, sequences, positions, q, layers: int, page_size: int) -> None:
    out = torch.empty_like(q)
    if mode == "grouped":
        groups = build_groups(sequences, positions, page_size, None)
        for layer in range(layers):
            attend(q, out, layer, storage, groups, 0.088)
    else:
        for layer in range(layers):
            attend_each(q, out, layer, storage, sequences, positions, 0.088, None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--chunk", type=int, nargs="+", default=[16, 64])
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    print(f"device {a.device} ({torch.cuda.get_device_name() if a.device.startswith('cuda') else 'cpu'}), "
          f"{dtype}, {a.layers} layers, Llama-3-8B attention (32 heads, 8 KV heads, d 128), contexts up to "
          f"{a.max_context}")
    print("| seqs | chunk | ops/step, each | ops/step, grouped | ms/step, each | ms/step, grouped | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for chunk in a.chunk:
        for seqs in a.seqs:
            step = make_step(random.Random(seqs), seqs, chunk, a.max_context, a.page_size, a.layers, a.device,
                             dtype)
            ops, ms = {}, {}
            for mode in ("each", "grouped"):
                run(mode, *step, a.layers, a.page_size)  # warm-up
                with OpCounter() as counter:
                    run(mode, *step, a.layers, a.page_size)
                ops[mode] = counter.count
                times = []
                for _ in range(a.repeats):
                    sync()
                    t = time.perf_counter()
                    run(mode, *step, a.layers, a.page_size)
                    sync()
                    times.append(1e3 * (time.perf_counter() - t))
                ms[mode] = statistics.median(times)
            print(f"| {seqs} | {chunk} | {ops['each']} | {ops['grouped']} | {ms['each']:.2f} | {ms['grouped']:.2f} | "
                  f"{ms['each'] / ms['grouped']:.2f}x |")


if __name__ == "__main__":
    main()

"""Paged decode attention split over the context (flash-decoding) against one pass, at decode batch sizes (not a test).

    python -m perf.kernels.bench_attention [--batches 1,2,4,8,16,32,64,128] [--seqs 128,512,2048,8192,32768]
                                           [--splits 1,2,4,8,16,32] [--rep-ms 5] [--out PATH]

Llama-3-8B's attention (32 query heads over 8 kv heads, head_dim 128, bf16, pages of 16 tokens of all 32 layers, as
the unified pool lays them out), ``batch`` sequences of ``seq`` tokens each in shuffled pages. Each (batch, seq) is
timed at every ``--splits`` count with ``triton.testing.do_bench_cudagraph`` (median; the merge kernel included
where splits > 1), every timed call reading the next of enough (page set, layer) pairs that the L2 cache (50 MB)
cannot hold them between repetitions. Printed per case: the one-pass kernel's time, the split count
``manylora.kernels.paged_attention.attention_splits`` picks and its time, the best count's, and the KV bytes over the
time
against the device-to-device copy bandwidth measured in the same run. Results go to ``--out`` as JSON lines
(default ``$OUT/bench_attention.jsonl`` when OUT is set); the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.testing

from manylora.kernels.paged_attention import attention_config, attention_splits, paged_decode_attention
from perf.kernels.bench_kernels import copy_bandwidth, cycling

NUM_LAYERS, PAGE, NUM_KV_HEADS, GROUP, HEAD_DIM = 32, 16, 8, 4, 128
UNIVERSE_BYTES = 256 * 2**20  # KV cycled through per case: several times the L2
MAX_POOL_BYTES = 40 * 2**30
DTYPE = torch.bfloat16


PAGE_ELEMS = NUM_LAYERS * 2 * PAGE * NUM_KV_HEADS * HEAD_DIM  # a page holds its tokens' K and V of every layer


def kv_bytes(batch: int, seq: int) -> int:
    """Bytes of K and V one layer's launch must read."""
    return batch * seq * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def pool_bytes(batch: int, seq: int) -> int:
    """Bytes of the pages that hold ``batch`` sequences of ``seq`` tokens."""
    return batch * -(-seq // PAGE) * PAGE_ELEMS * DTYPE.itemsize


def case_calls(batch: int, seq: int):
    """A function of a split count that gives the launches of one (batch, seq) at that count, over distinct
    (page set, layer) pairs that add up to at least UNIVERSE_BYTES of KV."""
    pages_per_seq = -(-seq // PAGE)
    one_set = batch * pages_per_seq
    sets = max(1, -(-UNIVERSE_BYTES // (kv_bytes(batch, seq) * NUM_LAYERS)))
    pool = torch.randn(sets * one_set * PAGE_ELEMS, dtype=DTYPE, device="cuda")
    perm = torch.randperm(sets * one_set, device="cuda").to(torch.int32).view(sets, batch, pages_per_seq)
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)

    def call(tables: torch.Tensor, layer: int, config: dict[str, int]):
        return lambda: paged_decode_attention(q, pool, tables, lens, HEAD_DIM**-0.5, out, layer=layer,
                                              num_layers=NUM_LAYERS, page_size=PAGE, num_kv_heads=NUM_KV_HEADS,
                                              config=config)  # fmt: skip

    def calls(splits: int) -> list:
        config = {**attention_config(GROUP, HEAD_DIM, PAGE), "SPLITS": splits}
        return [call(perm[s], layer, config) for s in range(sets) for layer in range(NUM_LAYERS)]

    return calls


def bench_us(calls: list, rep_ms: int) -> float:
    fn = cycling(calls)
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "bench_attention.jsonl") if os.environ.get("OUT") else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--seqs", default="128,512,2048,8192,32768")
    parser.add_argument("--splits", default="1,2,4,8,16,32")
    parser.add_argument("--rep-ms", type=int, default=5)
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_properties(device).multi_processor_count} SMs")
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s", flush=True)
    split_counts = [int(s) for s in args.splits.split(",")]
    records = []
    for batch in (int(b) for b in args.batches.split(",")):
        for seq in (int(s) for s in args.seqs.split(",")):
            if pool_bytes(batch, seq) > MAX_POOL_BYTES:
                continue
            chosen = attention_splits(batch, NUM_KV_HEADS, device)
            times = {}
            calls = case_calls(batch, seq)
            for splits in sorted(set(split_counts) | {1, chosen}):
                times[splits] = round(bench_us(calls(splits), args.rep_ms), 2)
            del calls
            torch.cuda.empty_cache()
            best = min(times, key=times.get)
            floor_us = kv_bytes(batch, seq) / copy_bw * 1e6
            rec = {"kind": "attention_splits", "batch": batch, "seq": seq, "floor_us": round(floor_us, 2),
                   "one_pass_us": times[1], "chosen_splits": chosen, "chosen_us": times[chosen], "best_splits": best,
                   "best_us": times[best], "speedup_vs_one_pass": round(times[1] / times[chosen], 2),
                   "chosen_over_best": round(times[chosen] / times[best], 3),
                   "chosen_x_floor": round(times[chosen] / floor_us, 2), "us_by_splits": times}
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"\n{'batch':>5} {'seq':>6} {'floor us':>9} | {'1 pass us':>9} {'xflr':>6} | {'splits':>6} {'us':>8} "
          f"{'xflr':>6} {'speedup':>7} | {'best':>4} {'us':>8} {'chosen/best':>11}")
    for r in records:
        print(f"{r['batch']:>5} {r['seq']:>6} {r['floor_us']:>9.2f} | {r['one_pass_us']:>9.2f} "
              f"{r['one_pass_us'] / r['floor_us']:>6.2f} | {r['chosen_splits']:>6} {r['chosen_us']:>8.2f} "
              f"{r['chosen_x_floor']:>6.2f} {r['speedup_vs_one_pass']:>7.2f} | {r['best_splits']:>4} "
              f"{r['best_us']:>8.2f} {r['chosen_over_best']:>11.3f}")
    print(f"\n{time.time() - start:.0f} s; results: {args.out}")


if __name__ == "__main__":
    main()

"""Capacity planner (offline): what fits on one GPU for a base model and a catalogue's rank mix.

python -m manylora.client plan --base-model <hf dir> --gpu-memory 141GiB --ranks 8:500,16:300,64:20 \
    --max-loras 64 --page-size 16 --prompt-len 512 --output-len 512 [--dtype bfloat16] [--json]

The numbers come from manylora.engine.memory.sizing (the module the engine sizes its pool with), so the
plan and the engine agree page for page.
"""

from __future__ import annotations

import argparse
import json
import re

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """'141GiB', '80GB', '1.5TiB', '512MiB', '1000' (bytes) -> bytes. GB = 10^9, GiB = 2^30."""
    match = SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 141GiB, 80GB, 1.5TiB, 512MiB)")
    return int(float(match.group(1)) * UNITS[unit])


def parse_ranks(text: str) -> dict[int, int]:
    """'8:500,16:300,64:20' -> {8: 500, 16: 300, 64: 20} (rank: how many adapters)."""
    ranks: dict[int, int] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        rank, sep, count = item.partition(":")
        try:
            r, n = int(rank), int(count) if sep else 1
        except ValueError:
            raise ValueError(f"--ranks wants RANK:COUNT[,RANK:COUNT...], got {item!r}") from None
        if r <= 0 or n < 0:
            raise ValueError(f"--ranks: rank must be > 0 and count >= 0, got {item!r}")
        ranks[r] = ranks.get(r, 0) + n
    if not ranks:
        raise ValueError("--ranks is empty")
    return ranks


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _arg(parse):
    """argparse type that shows parse's own message (argparse hides a plain ValueError's)."""

    def wrapped(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    wrapped.__name__ = parse.__name__
    return wrapped


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-model", required=True, help="Hugging Face checkpoint directory (config.json)")
    ap.add_argument("--gpu-memory", required=True, type=_arg(parse_size), help="GPU memory, e.g. 141GiB, 80GB")
    ap.add_argument("--ranks", required=True, type=_arg(parse_ranks), help="RANK:COUNT,... e.g. 8:500,16:300")
    ap.add_argument("--max-loras", type=int, default=32, help="distinct adapters in one batch (hot adapters)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.85)
    ap.add_argument("--host-memory", type=_arg(parse_size), default=64 << 30, help="host memory for the adapter cache")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")


def make_plan(args: argparse.Namespace):
    from manylora.engine.memory.sizing import plan_capacity
    from manylora.engine.model_config import ModelConfig
    from manylora.engine.models.loader import resolve_dtype

    cfg = ModelConfig.from_dir(args.base_model)
    return plan_capacity(
        cfg, args.gpu_memory, args.ranks, dtype=resolve_dtype(args.dtype, "cuda"), page_size=args.page_size,
        max_loras=args.max_loras, prompt_len=args.prompt_len, output_len=args.output_len,
        gpu_memory_fraction=args.gpu_memory_fraction, host_memory_bytes=args.host_memory,
    )


def format_plan(plan, dtype: str) -> str:
    lines = [
        f"{'GPU memory':<24}{human(plan.gpu_memory_bytes)}",
        f"{f'base weights ({dtype})':<24}{human(plan.weight_bytes)}",
        f"{'pool':<24}{plan.pool_pages} pages x {human(plan.page_bytes)} = {human(plan.pool_bytes)} "
        f"({plan.page_size} KV tokens per page; {plan.kv_tokens_if_no_adapters} KV tokens if no adapter is resident)",
        "",
        f"{'RANK':>6} {'COUNT':>7} {'WEIGHTS/ADAPTER':>16} {'POOL PAGES':>11} {'POOL BYTES':>12}",
    ]
    for c in plan.rank_classes:
        weights, pool_bytes = human(c.weight_bytes), human(c.pool_bytes)
        lines.append(f"{c.rank:>6} {c.count:>7} {weights:>16} {c.pool_pages:>11} {pool_bytes:>12}")
    lines += [
        "",
        f"whole catalogue resident        {plan.catalogue_pool_pages} pages "
        f"({'fits' if plan.catalogue_pool_pages <= plan.pool_pages else 'does not fit'} in {plan.pool_pages})",
        f"adapters resident at most       {plan.max_resident_adapters} (of this mix, with no KV)",
        f"hot adapters (max_loras)        {plan.hot_adapter_pages} pages at the largest rank",
        f"KV tokens beside hot adapters   {plan.kv_tokens_with_hot_adapters}",
        f"largest batch                   {plan.max_batch} requests of {plan.tokens_per_request} tokens",
        "",
        "recommended settings (config.pbtxt parameters / scripts/serve.py --param):",
    ]
    lines += [f"  {k}={v}" for k, v in plan.recommended.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from manylora.engine.errors import ModelLoadError

    try:
        plan = make_plan(args)
    except ModelLoadError as e:
        raise ValueError(str(e)) from None
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan, args.dtype))
    return 0

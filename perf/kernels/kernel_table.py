"""A compact side-by-side table of LoRA kernel timings from ``perf/kernels/bench_kernels.py`` JSON lines files.

    python -m perf.kernels.kernel_table new=kernels_new.jsonl base=kernels_base.jsonl --tokens 16 64

One row per (module, op, tokens, distinct adapters), one column per (file label, launch form) found: microseconds,
the multiple of the bytes floor and the speed-up over gather + bmm. What `python -m perf.device kernels` prints last.
"""

from __future__ import annotations

import argparse
import json


def rows(labelled: list[tuple[str, str]], tokens: set[int] | None) -> tuple[list[str], dict[tuple, dict[str, dict]]]:
    """(column names in order of appearance, {(module, op, tokens, distinct): {column: record}})."""
    columns: list[str] = []
    table: dict[tuple, dict[str, dict]] = {}
    for label, path in labelled:
        try:
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except OSError:
            continue  # a run that did not finish: its columns are left out
        for r in records:
            if r.get("kind") != "lora" or (tokens and r["tokens"] not in tokens):
                continue
            column = f"{label} {r['form']}"
            if column not in columns:
                columns.append(column)
            table.setdefault((r["module"], r["op"], r["tokens"], r["distinct"]), {})[column] = r
    return columns, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="LABEL=PATH")
    ap.add_argument("--tokens", type=int, nargs="*", help="only these batch sizes (default: all)")
    args = ap.parse_args()
    labelled = [tuple(item.split("=", 1)) if "=" in item else (item, item) for item in args.files]
    columns, table = rows(labelled, set(args.tokens or ()))
    print(f"{'module':8s} {'op':6s} {'T':>5s} {'d':>4s}  " + "  ".join(f"{c:>24s}" for c in columns))
    for (module, op, t, d), by_column in sorted(table.items()):
        cells = []
        for c in columns:
            r = by_column.get(c)
            cells.append(f"{r['us']:7.2f} ({r['x_floor']:5.2f}x) [{r.get('speedup_vs_bmm') or 0:4.1f}x]" if r
                         else f"{'-':>24s}")
        print(f"{module:8s} {op:6s} {t:5d} {d:4d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()

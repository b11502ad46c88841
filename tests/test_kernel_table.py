"""perf/kernels/kernel_table.py: the side-by-side table the H200 scripts print from bench_kernels.py's JSON lines."""

import json

from perf.kernels.kernel_table import rows


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rows_pair_the_files_by_shape_and_skip_what_is_missing(tmp_path):
    lora = {"kind": "lora", "module": "qkv", "op": "expand", "distinct": 8, "x_floor": 2.0, "speedup_vs_bmm": 5.0}
    _write(tmp_path / "new.jsonl", [{"kind": "copy", "bytes_per_s": 4e12}, {**lora, "tokens": 64, "form": "bgmv",
                                    "us": 8.0}, {**lora, "tokens": 16, "form": "bgmv", "us": 3.0},
                                    {**lora, "tokens": 64, "form": "sgmv-device", "us": 5.0}])
    _write(tmp_path / "base.jsonl", [{**lora, "tokens": 64, "form": "bgmv", "us": 21.0}])
    files = [("new", str(tmp_path / "new.jsonl")), ("base", str(tmp_path / "base.jsonl")),
             ("gone", str(tmp_path / "absent.jsonl"))]
    columns, table = rows(files, {64})
    assert columns == ["new bgmv", "new sgmv-device", "base bgmv"]
    assert list(table) == [("qkv", "expand", 64, 8)]
    assert {c: r["us"] for c, r in table[("qkv", "expand", 64, 8)].items()} == {
        "new bgmv": 8.0, "new sgmv-device": 5.0, "base bgmv": 21.0}
    assert set(rows(files, None)[1]) == {("qkv", "expand", 64, 8), ("qkv", "expand", 16, 8)}

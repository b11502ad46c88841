"""perf/engine/bench_moe_step.py on a tiny MoE shape under the interpreter: it runs, and its fused and
unfused LoRA paths agree while the adapters do change the logits."""

from __future__ import annotations

import re

from perf.engine import bench_moe_step


def test_bench_moe_step_smoke(device, capsys):
    bench_moe_step.main(["--shape", "tiny", "--device", device, "--batches", "3", "--adapters", "1", "2",
                         "--context", "20"])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"^\s+3\s+\d+ \|", line)]
    assert len(rows) == 2
    for row in rows:
        b_minus_c, b_minus_a = (float(v) for v in row.split("|")[-1].split())
        assert b_minus_c < 1e-3 < b_minus_a, row

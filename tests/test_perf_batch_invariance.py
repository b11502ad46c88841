"""perf/engine/batch_invariance.py on the CPU: in float32 a request's greedy tokens do not depend on what it is
batched with, with or without adapters, so the tool must find no difference in any composition."""

from __future__ import annotations

import json

from perf.engine import batch_invariance


def test_float32_outputs_do_not_depend_on_the_batch(tmp_path):
    out = tmp_path / "result.json"
    assert batch_invariance.main(["--shape", "tiny", "--device", "cpu", "--adapters", "0,4", "--requests", "20",
                                  "--solo", "3", "--workdir", str(tmp_path / "work"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32" and set(result["counts"]) == {"0", "4"}
    for rows in result["counts"].values():
        assert rows["again"]["requests"] == rows["reversed"]["requests"] == 20 and rows["solo"]["requests"] == 3
        assert [rows[k]["differ"] for k in ("again", "reversed", "solo")] == [0, 0, 0], rows


def test_compare_finds_where_two_runs_part():
    reference = {0: [5, 6, 7, 8], 1: [1, 2], 2: [9, 9, 9]}
    other = {0: [5, 6, 0, 8], 1: [1, 2], 2: [9, 9]}
    r = batch_invariance.compare(reference, other)
    assert r["differ"] == 2 and r["first_difference_min"] == 2 and r["first_difference_median"] == 2

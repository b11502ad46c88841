"""perf/capacity/engine_counters.py: a run's own counters from two readings of the engine's stats, and their table."""

from __future__ import annotations

import random

from perf.capacity.engine_counters import COUNTERS, LOOP_TIMES, counters_table, loop_split, run_counters


def _reading(rng: random.Random, base: dict | None = None) -> dict:
    reading = {k: (base or {}).get(k, 0) + rng.randrange(0, 5000) for k in COUNTERS}
    reading["host_load_seconds"] = (base or {}).get("host_load_seconds", 0.0) + rng.uniform(0, 30)
    reading.update({"running": rng.randrange(9), "device": "cpu", "mixed_step_buckets": [64, 128]})  # not counters
    return reading


def test_run_counters_are_the_differences_of_the_counters_only():
    rng = random.Random()
    before = _reading(rng)
    after = _reading(rng, before)
    counters = run_counters(before, after)
    assert set(counters) == set(COUNTERS)
    for k in COUNTERS:
        assert counters[k] == round(after[k] - before[k], 3)
    missing = rng.choice(COUNTERS)
    del after[missing]
    assert missing not in run_counters(before, after)  # a server of another version may not report one


def test_the_table_has_a_row_per_run_with_counters_and_the_time_a_step_took():
    rng = random.Random()
    entries = []
    for i, (target, n) in enumerate([("engine", 5), ("server_stream", 5), ("llm", 100)]):
        steps = rng.randrange(100, 4000)
        counters = {**{k: rng.randrange(0, 50) for k in COUNTERS}, "steps": steps,
                    **{k: rng.uniform(0, 60) for k in LOOP_TIMES}}
        if i == 1:
            del counters["loop_hook_seconds"]  # a server of another version may not report one
        entries.append({"target": target, "adapters": n, "call": i, "wall_s": rng.uniform(1, 60),
                        "meta": {"engine_counters": counters}})
    entries.append({"target": "vllm_k8", "adapters": 5, "call": 0, "wall_s": 10.0, "meta": {}})  # no counters
    table = counters_table(entries, str.upper).splitlines()
    assert len(table) == 2 + 3
    assert all(line.count("|") == table[0].count("|") for line in table)
    for line, e in zip(table[2:], entries[:3], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        steps = e["meta"]["engine_counters"]["steps"]
        assert cells[:4] == [e["target"].upper(), str(e["adapters"]), str(e["call"]), str(steps)]
        assert float(cells[4]) == round(1000 * e["wall_s"] / steps, 2)
        for cell, seconds in zip(cells[5:9], loop_split(e["meta"]["engine_counters"], e["wall_s"]), strict=True):
            assert cell == ("-" if seconds is None else f"{1000 * seconds / steps:.2f}")  # per step, by where it went
        others = [str(e["meta"]["engine_counters"][k]) for k in COUNTERS[1:] if k not in LOOP_TIMES]
        assert cells[9:] == others
    assert counters_table(entries[3:], str) == ""


def test_the_loops_seconds_beyond_the_runs_wall_time_come_out_of_its_waiting():
    rng = random.Random()
    for _ in range(200):
        step, hook = rng.uniform(1, 50), rng.uniform(0, 2)
        during = rng.uniform(0, 5)  # what the loop waited while the run lasted
        beyond = rng.uniform(0, 3)  # the readings' bracket around the run (client start and end)
        idle = during + beyond
        wall = step + hook + during  # the run's wall time: the loop's time while it lasted
        counters = {"loop_step_seconds": step, "loop_hook_seconds": hook, "loop_idle_seconds": idle}
        got = loop_split(counters, wall)
        assert got[:2] == (step, hook)
        assert abs(got[2] - during) < 1e-9 and abs(got[3] - beyond) < 1e-9
        assert abs(sum(got) - (step + hook + idle)) < 1e-9  # the parts still sum to the loop's time
        # a loop that took less than the wall (a pass in flight at a reading) has nothing outside the run
        assert loop_split(counters, step + hook + idle + rng.uniform(0, 1))[2:] == (idle, 0.0)
        # the outside part never exceeds the waiting: a run whose steps alone outlast the wall keeps none
        assert loop_split(counters, rng.uniform(0, step))[2:] == (0.0, idle)
    partial = {"loop_step_seconds": 3.0, "loop_idle_seconds": 1.0}  # a server that reports no sending time
    assert loop_split(partial, 3.5) == (3.0, None, 1.0, None)

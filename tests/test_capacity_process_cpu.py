"""perf/capacity/process_cpu.py: each process of a target grouped by its role, and the cores each role used between
two readings; on synthetic trees (the server's shape) and on real processes (a spawned child that burns a known
amount of CPU time)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time

from perf.capacity.process_cpu import ROLES, CpuReading, ProcessReading, cores_by_role, cpu_table, read_tree, roles


def _server_tree(cpu: dict[int, float]) -> dict[int, ProcessReading]:
    """tritonserver (1) with two preprocessing instances (2, 3), the generator stub (4) with its resource tracker (5)
    and spawned engine process (6), whose loaders (7, 8) and tracker (9) sit below it, and postprocessing (10)."""
    shape = {1: (0, "tritonserver", False), 2: (1, "stub:preprocessing", False), 3: (1, "stub:preprocessing", False),
             4: (1, "stub:generator", False), 5: (4, "python3", False), 6: (4, "python3", True),
             7: (6, "python3", True), 8: (6, "python3", True), 9: (6, "python3", False),
             10: (1, "stub:postprocessing", False)}
    return {pid: ProcessReading(parent, label, spawned, cpu.get(pid, 0.0))
            for pid, (parent, label, spawned) in shape.items()}


def test_the_server_tree_is_grouped_by_role():
    named = roles(_server_tree({}), root=1)
    assert named == {1: "tritonserver", 2: "stub:preprocessing", 3: "stub:preprocessing", 4: "stub:generator",
                     5: "other", 6: "engine process", 7: "loaders", 8: "loaders", 9: "other",
                     10: "stub:postprocessing"}
    assert set(named.values()) <= set(ROLES)


def test_the_in_process_target_is_its_own_engine_process():
    tree = {100: ProcessReading(1, "python3", False, 0.0), 101: ProcessReading(100, "python3", True, 0.0),
            102: ProcessReading(100, "python3", False, 0.0)}
    assert roles(tree, root=100) == {100: "engine process", 101: "loaders", 102: "other"}


def test_each_roles_cores_are_its_processes_cpu_seconds_between_the_readings_over_the_wall_time():
    rng = random.Random()
    start = {pid: rng.uniform(0, 100) for pid in range(1, 11)}
    used = {pid: rng.uniform(0, 20) for pid in range(1, 11)}
    wall = rng.uniform(5, 50)
    before = _server_tree(start)
    after = _server_tree({pid: start[pid] + used[pid] for pid in start})
    del before[8]  # a loader that started during the run counts from zero
    after[5] = ProcessReading(7, "python3", False, 3.0)  # pid 5 reused by another process: counts from zero
    cores = cores_by_role(before, after, 1, wall)
    expected = {"tritonserver": used[1], "stub:preprocessing": used[2] + used[3], "stub:generator": used[4],
                "engine process": used[6], "loaders": used[7] + start[8] + used[8], "other": 3.0 + used[9],
                "stub:postprocessing": used[10]}
    assert cores.keys() == expected.keys()
    for role, seconds in expected.items():
        assert abs(cores[role] - seconds / wall) < 1e-3, role
    assert cores_by_role(before, after, 1, 0.0) == {}


def test_a_spawned_child_burning_cpu_is_read_as_the_engines_loader(tmp_path):
    """A real process tree: a root (an engine process stand-in) that spawns a child through multiprocessing, which
    burns 0.5 s of CPU time (measured by its own clock, so the machine's load does not matter) and then sleeps."""
    done = tmp_path / "burnt"
    script = tmp_path / "root.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, pathlib, time

        def burn():
            t0 = time.process_time()
            while time.process_time() - t0 < 0.5:
                pass
            pathlib.Path({str(done)!r}).touch()
            time.sleep(60)

        if __name__ == "__main__":
            child = multiprocessing.get_context("spawn").Process(target=burn, daemon=True)
            child.start()
            time.sleep(60)
    """))
    root = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 30
        while len(read_tree(root.pid)) < 2 and time.monotonic() < deadline:  # the child is there before reading
            time.sleep(0.05)
        reading = CpuReading.now(root.pid)
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.exists()
        later = read_tree(root.pid)
        seconds = cores_by_role(reading.readings, later, root.pid, 1.0)  # wall 1: cores read as seconds
        assert 0.3 <= seconds["loaders"] <= 1.0, seconds  # its 0.5 s, less what it burnt before the first reading
        assert seconds.get("engine process", 0.0) < 0.3, seconds
    finally:
        root.kill()
        root.wait()


def test_the_table_shows_each_role_and_their_sum():
    entries = [{"target": "llm", "adapters": 5, "call": 0, "meta": {"process_cores": {
                    "tritonserver": 0.5, "stub:generator": 0.25, "engine process": 1.0}}},
               {"target": "engine", "adapters": 5, "call": 0, "meta": {"engine_counters": {"steps": 1}}}]
    table = cpu_table(entries, str).splitlines()
    assert len(table) == 3  # the header, its rule, the one entry with readings
    assert table[2] == "| llm | 5 | 0 | 0.50 | - | 0.25 | - | 1.00 | - | - | 1.75 |"
    assert cpu_table(entries[1:], str) == ""

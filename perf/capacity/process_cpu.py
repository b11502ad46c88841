"""The CPU each process of a target used over one offline run, in cores (CPU seconds over the run's wall seconds).

Where the server is slower than the in-process engine on the same requests and its engine loop neither waited for
work nor took long sending (engine_counters.py), the step itself was slower: one lead is the host's CPU, which the
Python-backend stubs (tokenizing, detokenizing, moving responses) share with the engine process's launches. A
reading of every process below the target's root (/proc/PID/stat: user + system time) before and after the run
says who used how much. Processes are grouped by role:

- ``tritonserver``; ``stub:MODEL`` (each Python-backend stub, summed over the model's instances);
- ``engine process``: the in-process target's own process (its client threads run there too), or the generator
  stub's spawned engine process;
- ``loaders``: the engine process's adapter loader processes; ``other``: the rest (multiprocessing's resource
  trackers).

A process that started during the run counts from zero; one that ended during it is missing from the second
reading and counts nothing (its seconds are lost: the loaders live as long as the engine, so this is rare).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from perf.capacity.soak import process_label, process_tree, stat_fields

ROLES = ("tritonserver", "stub:preprocessing", "stub:generator", "stub:postprocessing", "engine process", "loaders",
         "other")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")  # /proc counts CPU time in clock ticks


@dataclass(frozen=True)
class ProcessReading:
    """One process at one reading: its parent, its label (soak.process_label), whether multiprocessing spawned it,
    and its CPU seconds so far (user + system)."""

    parent: int
    label: str
    spawned: bool
    cpu_s: float


def read_process(pid: int) -> ProcessReading | None:
    """``pid``'s reading from /proc, or None where it is gone or unreadable."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    parent, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    spawned = b"spawn_main" in args and b"resource_tracker" not in args
    return ProcessReading(parent, process_label(pid), spawned, (utime + stime) / _TICKS_PER_S)


def read_tree(root: int) -> dict[int, ProcessReading]:
    """Every process from ``root`` down, read now."""
    readings = {}
    for pid in process_tree(root):
        reading = read_process(pid)
        if reading is not None:
            readings[pid] = reading
    return readings


def roles(readings: dict[int, ProcessReading], root: int) -> dict[int, str]:
    """Each process's role (ROLES) in a tree read from ``root``."""
    engine = _engine_process(readings, root)

    def below_engine(pid: int) -> bool:
        seen = set()
        while pid in readings and pid not in seen:
            seen.add(pid)
            pid = readings[pid].parent
            if pid == engine:
                return True
        return False

    named = {}
    for pid, r in readings.items():
        if pid == engine:
            named[pid] = "engine process"
        elif r.label == "tritonserver" or r.label.startswith("stub:"):
            named[pid] = r.label if r.label in ROLES else "other"
        elif engine is not None and r.spawned and below_engine(pid):
            named[pid] = "loaders"
        else:
            named[pid] = "other"
    return named


def _engine_process(readings: dict[int, ProcessReading], root: int) -> int | None:
    """The engine's process: the root itself unless it is tritonserver, else the generator stub's spawned child."""
    if root in readings and readings[root].label != "tritonserver":
        return root
    for pid, r in readings.items():
        parent = readings.get(r.parent)
        if r.spawned and parent is not None and parent.label == "stub:generator":
            return pid
    return None


def cores_by_role(before: dict[int, ProcessReading], after: dict[int, ProcessReading], root: int,
                  wall_s: float) -> dict[str, float]:
    """The cores each role used between two readings of the tree below ``root``, over ``wall_s`` seconds."""
    if wall_s <= 0:
        return {}
    used: dict[str, float] = {}
    for pid, role in roles(after, root).items():
        start = before.get(pid)
        cpu = after[pid].cpu_s - (start.cpu_s if start is not None and start.parent == after[pid].parent else 0.0)
        used[role] = used.get(role, 0.0) + max(0.0, cpu)
    return {role: round(seconds / wall_s, 3) for role, seconds in used.items()}


@dataclass(frozen=True)
class CpuReading:
    """The tree below ``root`` read at one moment; ``cores_since`` reads it again and gives each role's cores over
    the seconds between the two readings (they bracket the run: the client processes start after the first)."""

    root: int
    readings: dict[int, ProcessReading]
    at: float

    @classmethod
    def now(cls, root: int) -> CpuReading:
        return cls(root, read_tree(root), time.monotonic())

    def cores_since(self) -> dict[str, float]:
        later = CpuReading.now(self.root)
        return cores_by_role(self.readings, later.readings, self.root, later.at - self.at)


def cpu_table(entries: Iterable[dict], label: Callable[[str], str]) -> str:
    """A markdown table of the offline entries that carry ``meta["process_cores"]`` (``label``: target -> its
    name); empty when none carries them."""
    rows = [e for e in entries if e.get("meta", {}).get("process_cores")]
    if not rows:
        return ""
    lines = ["| target | n | call | " + " | ".join(ROLES) + " | all |", "|---" * (len(ROLES) + 4) + "|"]
    for e in sorted(rows, key=lambda e: (e.get("call", 0), e["target"], e["adapters"])):
        cores = e["meta"]["process_cores"]
        cells = [label(e["target"]), e["adapters"], e.get("call", "-"),
                 *(f"{cores[r]:.2f}" if r in cores else "-" for r in ROLES), f"{sum(cores.values()):.2f}"]
        lines.append("| " + " | ".join(str(v) for v in cells) + " |")
    return "\n".join(lines) + "\n"

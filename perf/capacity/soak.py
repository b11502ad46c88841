"""The soak: the server under steady open-loop load for a while, its memory sampled as it goes.

Every ``interval_s`` the sampler reads the resident set (VmRSS, /proc/PID/status) of tritonserver
and of every process below it (the Python-backend stubs, the engine's adapter loaders), and, where
nvidia-smi exists, each process's GPU memory (``--query-compute-apps=pid,used_memory``). The summary
gives each process's start / end / max and the least-squares slope in MB per minute: a leak shows as a
slope that does not level off.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from perf.capacity.metrics import linear_slope, summarize_sweep_point
from perf.capacity.requests import CapacityRequest, poisson_schedule
from perf.capacity.runs import Driver, run_name, write_records

MB = 1024 * 1024


@dataclass(frozen=True)
class SoakConfig:
    """duration_s of arrivals at ``fraction`` x the server's offline capacity; memory every interval_s."""

    duration_s: float
    fraction: float = 0.9
    interval_s: float = 5.0
    drain_s: float = 30.0
    seed: int = 2


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state (field 3) on, or None where the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after the last ')' are fixed
    return stat[stat.rindex(")") + 2 :].split()


def _parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def process_label(pid: int) -> str:
    """'tritonserver', 'stub:generator' (the model whose model.py a Python-backend stub runs), or the command name."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"
    if args and args[0].endswith(b"triton_python_backend_stub") and len(args) > 1:
        model = Path(args[1].decode(errors="replace")).parent.parent.name
        return f"stub:{model}"
    return name


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def gpu_memory_by_pid() -> dict[int, float] | None:
    """MiB of GPU memory per process (nvidia-smi); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    usage: dict[int, float] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                usage[int(parts[0])] = usage.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return usage


class MemorySampler:
    """A thread sampling the RSS of a process tree (and GPU memory) every ``interval_s``."""

    def __init__(self, root: int, interval_s: float) -> None:
        self.root = root
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> MemorySampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the end state

    def sample(self) -> None:
        rss = {}
        for pid in process_tree(self.root):
            value = rss_bytes(pid)
            if value is not None:
                rss[pid] = value / MB
                if pid not in self.labels:
                    self.labels[pid] = process_label(pid)
        gpu = gpu_memory_by_pid()
        everyone = None if gpu is None else sum(gpu.values())
        if gpu is not None:
            gpu = {pid: mib for pid, mib in gpu.items() if pid in rss}
        self.samples.append({"t": round(time.monotonic() - self._t0, 3), "rss_mb": rss, "gpu_mib": gpu,
                             "gpu_all_mib": everyone})

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return


def _series_summary(times: list[float], values: list[float]) -> dict:
    slope = linear_slope(times, values)
    return {
        "start_mb": round(values[0], 1),
        "end_mb": round(values[-1], 1),
        "max_mb": round(max(values), 1),
        "slope_mb_per_min": None if slope is None else round(slope * 60, 3),
    }


def summarize_memory(samples: list[dict], labels: dict[int, str]) -> dict:
    """Per process (label and pid) and in total: start / end / max MB and the slope in MB per minute.

    GPU memory per process of the tree where nvidia-smi lists it, and of every compute process on the
    machine (in a container nvidia-smi may list host PIDs that match none of ours).
    """
    if not samples:
        return {}
    result: dict = {"host_rss": {}, "gpu": {}}
    pids = sorted({pid for s in samples for pid in s["rss_mb"]})
    for pid in pids:
        points = [(s["t"], s["rss_mb"][pid]) for s in samples if pid in s["rss_mb"]]
        result["host_rss"][f"{labels.get(pid, 'pid')} ({pid})"] = _series_summary(*map(list, zip(*points, strict=True)))
    totals = [(s["t"], sum(s["rss_mb"].values())) for s in samples]
    result["host_rss"]["total"] = _series_summary(*map(list, zip(*totals, strict=True)))
    gpu_samples = [s for s in samples if s["gpu_mib"] is not None]
    if gpu_samples:
        for pid in sorted({pid for s in gpu_samples for pid in s["gpu_mib"]}):
            points = [(s["t"], s["gpu_mib"][pid]) for s in gpu_samples if pid in s["gpu_mib"]]
            result["gpu"][f"{labels.get(pid, 'pid')} ({pid})"] = _series_summary(*map(list, zip(*points, strict=True)))
        points = [(s["t"], s["gpu_all_mib"]) for s in gpu_samples]
        result["gpu_all_processes"] = _series_summary(*map(list, zip(*points, strict=True)))
    else:
        result["gpu"] = None  # no nvidia-smi
    result["samples"] = len(samples)
    return result


def run_soak(
    driver: Driver,
    target: str,
    adapters: int,
    requests: list[CapacityRequest],
    capacity_rps: float,
    config: SoakConfig,
    server_pid: int,
    runs_dir: Path,
) -> dict:
    """``config.duration_s`` of Poisson arrivals at ``config.fraction`` x ``capacity_rps``, memory sampled."""
    rate = config.fraction * capacity_rps
    schedule = poisson_schedule(requests, rate, config.duration_s, config.seed)
    sampler = MemorySampler(server_pid, config.interval_s).start()
    try:
        outcome = driver.run(schedule, cap_s=config.duration_s + config.drain_s, keep_ids=False)
    finally:
        sampler.stop()
    warmup = min(config.duration_s / 4, 15.0)
    point = summarize_sweep_point(target, adapters, config.fraction, rate, config.duration_s, warmup,
                                  outcome.records, outcome.end_s, outcome.clients)
    name = f"soak_{run_name(target, adapters, config.fraction)}"
    write_records(runs_dir / f"{name}.jsonl", outcome.records)
    with open(runs_dir / f"{name}.memory.jsonl", "w") as f:
        for s in sampler.samples:
            f.write(json.dumps(s) + "\n")
    return {
        "target": target,
        "adapters": adapters,
        "duration_s": config.duration_s,
        "fraction": config.fraction,
        "interval_s": config.interval_s,
        "capacity_rps": capacity_rps,
        "load": asdict(point),
        "memory": summarize_memory(sampler.samples, sampler.labels),
    }

"""The GPU's clocks, power and temperature through a call, sampled by nvidia-smi, and their summary over one run.

The same engine on the same GPU has given throughputs 8% apart in one session; a run at lower clocks than another
(heat, a power cap, a clock event) is told apart from a slower code path only by what the GPU did during each run.
A run's window is ``meta["window"]`` of its result (epoch seconds, set by ``runs.measure_offline`` and the vLLM
child); the summary goes into ``meta["gpu"]`` and a note.
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
EVENTS = "clocks_event_reasons.active"  # a bit mask; nvidia-smi releases without it are sampled without
TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


@dataclass(frozen=True)
class GpuWindow:
    """What the GPU did over one run: means over its samples, the lowest SM clock, the hottest moment, and the clock
    event masks seen other than 0 (nvidia-smi's ``clocks_event_reasons.active``: power cap, thermal, ...)."""

    samples: int
    sm_clock_mhz_mean: float
    sm_clock_mhz_min: float
    mem_clock_mhz_mean: float
    power_w_mean: float
    temperature_c_max: float
    clock_events: tuple[str, ...]

    def note(self) -> str:
        events = ", ".join(self.clock_events) if self.clock_events else "none"
        return (f"SM clock mean {self.sm_clock_mhz_mean:,.0f} MHz (min {self.sm_clock_mhz_min:,.0f}), memory clock "
                f"{self.mem_clock_mhz_mean:,.0f} MHz, power mean {self.power_w_mean:,.0f} W, temperature max "
                f"{self.temperature_c_max:.0f} C, clock events {events} ({self.samples} samples)")


def parse_samples(text: str) -> list[tuple[float, list[str]]]:
    """(epoch seconds, the other fields) of each well-formed line of nvidia-smi's csv,noheader,nounits output."""
    samples = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < len(FIELDS):
            continue
        try:
            when = dt.datetime.strptime(cells[0], TIME_FORMAT).timestamp()
        except ValueError:
            continue
        samples.append((when, cells[1:]))
    return samples


def summarize(samples: list[tuple[float, list[str]]], start: float, end: float) -> GpuWindow | None:
    """The samples taken in [start, end] (epoch seconds); None when there are none with numbers."""
    rows = []
    events: set[str] = set()
    for when, cells in samples:
        if not start <= when <= end:
            continue
        try:
            sm, mem, power, temp = (float(c) for c in cells[:4])
        except ValueError:  # "[N/A]" and the like
            continue
        rows.append((sm, mem, power, temp))
        if len(cells) > 4 and cells[4] not in ("", "0x0000000000000000", "0x0", "[N/A]"):
            events.add(cells[4])
    if not rows:
        return None
    n = len(rows)
    return GpuWindow(samples=n, sm_clock_mhz_mean=sum(r[0] for r in rows) / n, sm_clock_mhz_min=min(r[0] for r in rows),
                     mem_clock_mhz_mean=sum(r[1] for r in rows) / n, power_w_mean=sum(r[2] for r in rows) / n,
                     temperature_c_max=max(r[3] for r in rows), clock_events=tuple(sorted(events)))


class GpuSampler:
    """nvidia-smi sampling GPU ``index`` every ``interval_ms`` into ``out`` from ``start`` to ``stop``."""

    def __init__(self, out: Path, index: int = 0, interval_ms: int = 500) -> None:
        self.out, self.index, self.interval_ms = out, index, interval_ms
        self._proc: subprocess.Popen | None = None

    def start(self) -> str | None:
        """Start sampling; None, or why not (no nvidia-smi, or it refuses every query)."""
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return "nvidia-smi is not on PATH"
        for fields in ((*FIELDS, EVENTS), FIELDS):
            query = [smi, "-i", str(self.index), f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
            try:
                probe = subprocess.run(query, capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"nvidia-smi failed: {e}"
            if probe.returncode == 0:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                with open(self.out, "w") as f:
                    self._proc = subprocess.Popen([*query, f"--loop-ms={self.interval_ms}"], stdout=f,
                                                  stderr=subprocess.DEVNULL)
                return None
        return f"nvidia-smi refused the query: {probe.stdout.strip() or probe.stderr.strip()}"

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def window(self, start: float, end: float) -> GpuWindow | None:
        """The summary of what was sampled in [start, end] so far (None without samples there)."""
        if not self.out.is_file():
            return None
        return summarize(parse_samples(self.out.read_text(errors="replace")), start, end)

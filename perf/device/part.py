"""One part of ``python -m perf.device``: its steps run one after the other under time limits, their logs in a
work folder, a short summary printed last.

A part fits in 10 minutes of a GPU machine (a budget of 570 s by default: each step's limit is what the part has
left, or less). Every step's exit code and end time go to ``times.txt`` (124: its time limit), the GPU and the
torch / Triton versions to ``gpu.txt``; at the end the summary is written to ``OUT/<part>.txt``, the work folder
(``/tmp/perf-device/<part>``) is packed into ``OUT/<part>.tgz``, and the summary is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK_ROOT = Path("/tmp/perf-device")


def default_out() -> Path:
    return Path(os.environ.get("OUT") or WORK_ROOT / "out")


def run_logged(command: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None,
               cwd: Path = REPO) -> int:
    """Run ``command`` with stdout and stderr into ``log``; past ``timeout_s`` its process group is stopped
    (SIGTERM, then SIGKILL after 10 s) and the exit code is 124, as coreutils' ``timeout`` gives."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            stop_group(proc)
            return 124
        except BaseException:
            stop_group(proc)
            raise


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the process's group, SIGKILL if it is still there after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def grep(path: Path, pattern: str, cut: int = 200, head: int | None = None, tail: int | None = None) -> str:
    """The lines of ``path`` matching ``pattern`` (a regular expression), each cut to ``cut`` characters."""
    try:
        text = path.read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return f"({path.name} missing)"
    lines = [line[:cut] for line in text.splitlines() if re.search(pattern, line)]
    if head is not None:
        lines = lines[:head]
    if tail is not None:
        lines = lines[-tail:]
    return "\n".join(lines)


class Part:
    """A part's work folder, environment, time budget, step log and summary."""

    def __init__(self, name: str, out: Path | None = None, budget_s: float = 570.0, python: str | None = None):
        self.name = name
        self.out = Path(out) if out else default_out()
        self.work = WORK_ROOT / name
        self.budget_s = budget_s
        self.python = python or sys.executable  # the image's python3 on the GPU machine (torch, triton)
        self.t0 = time.monotonic()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.out.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        self.summary: list[str] = []

    def left(self, at_least: float = 30.0, budget_s: float | None = None) -> float:
        """Seconds left of the part's budget (or of ``budget_s`` since it began), at least ``at_least``."""
        budget = self.budget_s if budget_s is None else budget_s
        return max(at_least, budget - (time.monotonic() - self.t0))

    def stamp(self, label: str, rc: int | str) -> None:
        with open(self.work / "times.txt", "a") as f:
            f.write(f"{label} rc={rc} at {time.monotonic() - self.t0:.0f} s\n")

    def step(self, label: str, command: list[str], log: str, limit_s: float | None = None,
             env: dict[str, str] | None = None) -> int:
        """Run one step into ``<work>/<log>`` under ``limit_s`` (at most what the budget has left); stamped."""
        limit = self.left() if limit_s is None else min(limit_s, self.left())
        rc = run_logged(command, self.work / log, limit, env={**self.env, **(env or {})})
        self.stamp(label, rc)
        return rc

    def python_step(self, label: str, module: str, args: list[str], log: str, limit_s: float | None = None,
                    env: dict[str, str] | None = None) -> int:
        """``python -m module args`` as a step (the part's interpreter)."""
        return self.step(label, [self.python, "-m", module, *args], log, limit_s, env)

    def compiled_tests(self, pytest_args: list[str], limit_s: float | None = None, log: str = "gpu_tests.txt",
                       env: dict[str, str] | None = None) -> int:
        """The tests compiled on the GPU (``TRITON_INTERPRET=0``), quiet, no cache folder."""
        return self.python_step("compiled tests", "pytest", ["-q", "-p", "no:cacheprovider", *pytest_args], log,
                                limit_s, {"TRITON_INTERPRET": "0", **(env or {})})

    def gpu_info(self) -> None:
        """``gpu.txt``: nvidia-smi's name, driver, memory and clocks; the torch and Triton versions."""
        lines = []
        smi = shutil.which("nvidia-smi")
        if smi:
            query = "name,driver_version,memory.total,clocks.sm,clocks.mem"
            done = subprocess.run([smi, f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True)
            lines.append((done.stdout + done.stderr).strip())
        else:
            lines.append("no nvidia-smi")
        done = subprocess.run([self.python, "-c", "import torch, triton; print('torch', torch.__version__, "
                                                  "'triton', triton.__version__)"], capture_output=True, text=True)
        lines.append((done.stdout or done.stderr).strip())
        (self.work / "gpu.txt").write_text("\n".join(lines) + "\n")

    def add(self, title: str, text: str = "") -> None:
        """A section of the summary: ``== title`` and its text."""
        self.summary.append(f"== {title}" + (f"\n{text.rstrip()}" if text.strip() else ""))

    def head(self) -> list[str]:
        """The summary's head: the GPU, every step's exit code and time, the compiled tests' outcome."""
        lines = [(self.work / n).read_text().rstrip() for n in ("gpu.txt", "times.txt") if (self.work / n).is_file()]
        if (self.work / "gpu_tests.txt").is_file():
            tests = grep(self.work / "gpu_tests.txt", r"passed|failed|FAILED|rror", tail=8)
            lines.append("== compiled tests" + (f"\n{tests}" if tests else ""))
        return lines

    def finish(self, remove: tuple[str, ...] = ()) -> str:
        """Write ``OUT/<part>.txt`` (the head, then the sections added), pack the work folder into
        ``OUT/<part>.tgz`` (less the folders named in ``remove``), return the summary."""
        for name in remove:
            shutil.rmtree(self.work / name, ignore_errors=True)
        text = "\n".join(self.head() + self.summary) + "\n"
        (self.out / f"{self.name}.txt").write_text(text)
        with tarfile.open(self.out / f"{self.name}.tgz", "w:gz") as tar:
            tar.add(self.work, arcname=self.name)
        return text

"""``python -m perf.device server-probe``: when the server misbehaves on the GPU machine (the generator's stub
answering "not healthy", requests that never finish), per variant of engine parameters: start the server, send a
few short requests one by one, and sample the stub process meanwhile.

Every 0.5 s: each stub thread's state, name and wait channel, the stub's CPU time, the cgroup's CPU throttling and
memory events, available memory; a py-spy dump (Python and native frames) of the stub 2 s and 8 s into the
requests when ``.gpu/tools/py-spy.xz`` is there (``xz -9 -c $(which py-spy) > .gpu/tools/py-spy.xz`` on a
machine that has py-spy); every thread's stack written by faulthandler (SIGUSR1, registered by the model) into the
server log. The Python backend's parent calls a stub unhealthy when the stub's health thread (a C++ thread that
needs no GIL) has not set its flag within one second.

Writes ``probe.txt`` (one row per variant), ``probe_detail.txt`` (the first variant's stacks and samples) and,
in the part's archive, every variant's server log, samples and dumps.
"""

from __future__ import annotations

import lzma
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from perf.device.part import REPO, Part, grep
from perf.device.server import STUB, Model, pids_matching, signal_stubs, start_model_server

PY_SPY_XZ = REPO / ".gpu" / "tools" / "py-spy.xz"


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def sample_block(session: int) -> str:
    """One sample: the generator stubs' threads (those not sleeping listed), the cgroup's CPU and memory."""
    lines = [f"@ {time.time():.3f}"]
    for pid in pids_matching(STUB, session):
        stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
        if len(stat) > 17:  # fields from the state on: state 0, utime 11, stime 12, threads 17
            lines.append(f"pid {pid} state {stat[0]} utime {stat[11]} stime {stat[12]} threads {stat[17]}")
        sleeping = 0
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            state = _read(f"{task}/stat").rsplit(")", 1)[-1].split()[:1]
            if state == ["S"]:
                sleeping += 1
                continue
            lines.append(f"  {task.name} {''.join(state)} {_read(f'{task}/comm')} {_read(f'{task}/wchan')}")
        lines.append(f"  sleeping threads: {sleeping}")
    lines.append(f"cpu.stat {_read('/sys/fs/cgroup/cpu.stat').replace(chr(10), ' ')}")
    lines.append(f"memory.events {_read('/sys/fs/cgroup/memory.events').replace(chr(10), ' ')} "
                 f"current {_read('/sys/fs/cgroup/memory.current')}")
    lines.append(" ".join(line for line in _read("/proc/meminfo").splitlines()
                          if line.startswith(("MemAvailable:", "Dirty:", "Writeback:"))))
    return "\n".join(lines) + "\n"


def throttled_us() -> int:
    match = re.search(r"throttled_usec (\d+)", _read("/sys/fs/cgroup/cpu.stat"))
    return int(match.group(1)) if match else 0


def py_spy() -> str:
    """A py-spy binary unpacked from .gpu/tools, or empty."""
    if not PY_SPY_XZ.is_file():
        return shutil.which("py-spy") or ""
    target = Path("/tmp/py-spy")
    target.write_bytes(lzma.decompress(PY_SPY_XZ.read_bytes()))
    target.chmod(0o755)
    return str(target)


def _dumps(folder: Path, spy: str, session: int, stop: threading.Event) -> None:
    for at, wait in ((2, 2), (8, 6)):
        if stop.wait(wait) or not spy:
            return
        for pid in pids_matching(STUB, session):
            for native, name in ((True, f"pyspy_native_{at}s.txt"), (False, f"pyspy_{at}s.txt")):
                with open(folder / name, "w") as f:
                    subprocess.run([spy, "dump", "--pid", str(pid), *(["--native"] if native else [])], stdout=f,
                                   stderr=subprocess.STDOUT, timeout=30, check=False)


def _sampler(path: Path, session: int, stop: threading.Event) -> None:
    with open(path, "w") as f:
        while not stop.is_set():
            f.write(sample_block(session))
            f.flush()
            stop.wait(0.5)


def probe_variant(part: Part, model: Model, server_python: str, server_env: dict[str, str], variant: str,
                  index: int, trace: Path, spy: str) -> str:
    """One variant (space-separated key=value engine parameters); its table row."""
    folder = part.work / f"v{index}"
    folder.mkdir()
    (folder / "variant.txt").write_text(variant + "\n")
    server = start_model_server(part, model, server_python, server_env, variant.split(), folder / "server.log")
    throttled0 = throttled_us()
    stop = threading.Event()
    threads = [threading.Thread(target=_sampler, args=(folder / "samples.txt", server.session, stop), daemon=True),
               threading.Thread(target=_dumps, args=(folder, spy, server.session, stop), daemon=True)]
    for t in threads:
        t.start()
    try:
        part.step(f"probe v{index}", [server_python, "-m", "perf.workload.runner", "--trace", str(trace), "--url",
                                      server.grpc_url, "--model", "generator", "--name", f"probe_v{index}",
                                      "--max-duration", "30", "--no-progress", "--out", str(folder)],
                  f"v{index}/runner.txt", 60, env=server_env)
        if signal_stubs(server.session, signal.SIGUSR1):
            time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=40)
        server.stop()
        time.sleep(3)
    records = "\n".join(p.read_text() for p in folder.glob("*requests*.jsonl"))
    done = records.count('"error": null')
    errors = sorted(set(re.findall(r'"error": "([^"]*)"', records)))[:3]
    samples = (folder / "samples.txt").read_text() if (folder / "samples.txt").is_file() else ""
    busiest = max((block.count(" D ") + block.count(" R ") for block in samples.split("@ ")), default=0)
    oom = re.findall(r"oom_kill \d+", samples)
    sent = len(trace.read_text().splitlines())
    ready_s = f"{server.ready_s:.0f}" if server.ready_s is not None else "not ready"
    return (f"| {variant or 'defaults'} | {ready_s} | {sent} | {done} | {'; '.join(errors) or 'none'} | {busiest} | "
            f"{(throttled_us() - throttled0) // 1_000_000} | {oom[-1] if oom else '?'} |")


def server_probe(part: Part, model: Model, server_python: str, server_env: dict[str, str],
                 variants: list[str]) -> None:
    trace = part.work / "trace.jsonl"
    part.python_step("probe trace", "perf.workload.trace",
                     ["--adapters", str(model.adapters), "--alpha", "1", "--rate", "1", "--cv", "1", "--duration", "4",
                      "--input-range", "16", "64", "--output-range", "8", "24", "--vocab-range", "4", str(model.vocab),
                      "--out", str(trace)], "trace.txt", 60)
    spy = py_spy()
    rows = [f"cores {len(os.sched_getaffinity(0))}, cpu.max {_read('/sys/fs/cgroup/cpu.max')}, "
            f"memory.max {_read('/sys/fs/cgroup/memory.max')}",
            "| variant | ready (s) | sent | done | errors | stub threads in D/R (max) | throttled (s) | oom events |",
            "|---|---|---|---|---|---|---|---|"]
    for i, variant in enumerate(variants or [""], start=1):
        rows.append(probe_variant(part, model, server_python, server_env, variant, i, trace, spy))
    (part.work / "probe.txt").write_text("\n".join(rows) + "\n")
    first = part.work / "v1"
    detail = ["== generator stub stacks (py-spy, native) of variant 1, 2 s in",
              grep(first / "pyspy_native_2s.txt", ".", head=150),
              "== stub stacks (faulthandler, SIGUSR1) of variant 1",
              grep(first / "server.log", r"^Thread 0x|^Current thread|^  File", head=120),
              "== stub threads not sleeping, variant 1 (first 60 lines)",
              grep(first / "samples.txt", r"^(?!cpu\.stat|memory|MemAvail)", head=60)]
    (part.work / "probe_detail.txt").write_text("\n".join(detail) + "\n")
    part.add("probe", "\n".join(rows))

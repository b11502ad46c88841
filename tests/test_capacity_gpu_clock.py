"""perf/capacity/gpu_clock.py: what the GPU did during each capacity run, from nvidia-smi's samples (here a stand-in
nvidia-smi that prints the same csv), and the note the call adds to each offline result."""

from __future__ import annotations

import datetime as dt
import os
import random
import stat
import sys
import time
from types import SimpleNamespace

from perf.capacity.command import Call
from perf.capacity.gpu_clock import GpuSampler, parse_samples, summarize
from perf.capacity.store import Store


def _line(when: float, sm, mem, power, temp, events="0x0000000000000000") -> str:
    stamp = dt.datetime.fromtimestamp(when).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {sm}, {mem}, {power}, {temp}, {events}"


def test_a_window_summarizes_only_its_own_samples():
    rng = random.Random(4)
    t0 = 1_800_000_000.0
    inside = [(rng.uniform(1500, 1980), rng.uniform(2600, 3200), rng.uniform(300, 700), rng.uniform(40, 80))
              for _ in range(6)]
    lines = [_line(t0 - 5, 345, 3201, 90, 30)]  # idle, before the run
    lines += [_line(t0 + i, *s, events="0x0000000000000004" if i == 2 else "0x0000000000000000")
              for i, s in enumerate(inside)]
    lines += [_line(t0 + 60, 345, 3201, 90, 99), "garbage line", _line(t0 + 3.5, "[N/A]", 1, 1, 1)]
    gpu = summarize(parse_samples("\n".join(lines)), t0 - 0.5, t0 + len(inside))
    assert gpu.samples == len(inside)
    assert abs(gpu.sm_clock_mhz_mean - sum(s[0] for s in inside) / len(inside)) < 1e-6
    assert gpu.sm_clock_mhz_min == min(s[0] for s in inside)
    assert abs(gpu.power_w_mean - sum(s[2] for s in inside) / len(inside)) < 1e-6
    assert gpu.temperature_c_max == max(s[3] for s in inside)  # the 99 C after the run is not in it
    assert gpu.clock_events == ("0x0000000000000004",)
    assert summarize(parse_samples("\n".join(lines)), t0 + 100, t0 + 200) is None


FAKE_SMI = '''#!{python}
import datetime, sys, time
events = "clocks_event_reasons.active" in " ".join(sys.argv)
def line():
    stamp = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return stamp + ", 1755, 2619, 512.25, 61" + (", 0x0000000000000000" if events else "")
if events and {refuse_events}:
    print("Field clocks_event_reasons.active is not a valid field to query."); sys.exit(2)
if any(a.startswith("--loop-ms") for a in sys.argv):
    while True:
        print(line(), flush=True); time.sleep(0.05)
print(line())
'''


def _fake_smi(tmp_path, monkeypatch, refuse_events: bool) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True)
    smi.write_text(FAKE_SMI.format(python=sys.executable, refuse_events=refuse_events))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


def test_the_sampler_runs_nvidia_smi_and_falls_back_without_the_event_field(tmp_path, monkeypatch):
    for refuse_events in (False, True):
        _fake_smi(tmp_path / str(refuse_events), monkeypatch, refuse_events)
        sampler = GpuSampler(tmp_path / str(refuse_events) / "gpu.csv", interval_ms=50)
        start = time.time()
        assert sampler.start() is None
        time.sleep(0.6)
        sampler.stop()
        gpu = sampler.window(start, time.time())
        assert gpu is not None and gpu.samples >= 3 and gpu.sm_clock_mhz_mean == 1755 and gpu.power_w_mean == 512.25
        assert gpu.clock_events == ()


def test_no_nvidia_smi_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "not on PATH" in GpuSampler(tmp_path / "gpu.csv").start()


def test_each_offline_result_carries_what_the_gpu_did_during_its_run(tmp_path):
    t0 = 1_800_000_000.0
    csv = tmp_path / "gpu.csv"
    csv.write_text("\n".join(_line(t0 + i, 1980 - 10 * i, 3201, 600, 50 + i) for i in range(10)) + "\n")
    store = Store(tmp_path / "store.json", {"shape": "tiny"})
    call = SimpleNamespace(gpu=GpuSampler(csv), store=store, index=3)
    result = {"target": "server_stream", "adapters": 5, "meta": {"window": [t0 + 2, t0 + 4]}, "req_per_s": 1.0}
    Call.put_offline(call, result)
    assert result["meta"]["gpu"]["samples"] == 3 and result["meta"]["gpu"]["sm_clock_mhz_min"] == 1940
    assert any(n.startswith("GPU during server, streaming n=5 (call 3): SM clock mean 1,950 MHz (min 1,940)")
               for n in store.data["notes"]), store.data["notes"]
    without = {"target": "engine", "adapters": 0, "meta": {}}
    Call.put_offline(SimpleNamespace(gpu=None, store=store, index=3), without)
    assert "gpu" not in without["meta"]

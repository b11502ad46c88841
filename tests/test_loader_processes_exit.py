"""The engine process with adapter loader processes (the default on CUDA) ends cleanly: its stop with loads in
flight exits with code 0 and takes its loaders with it, and the loaders of an engine process that was killed exit
on their own, leaving no packed file behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from processes import process_alive

from manylora.engine.adapters.process_loader import FILE_PREFIX, choose_directory
from manylora.engine.requests.types import GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine_process import EngineLaunch, EngineProcess
from model_factory import make_base, write_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAMES = 60  # adapter names over a few directories: each name is a load of its own
# two adapters fit the GPU tier and two the host tier: the loaders are busy for as long as requests run
KNOBS = {"max_model_len": "256", "max_num_seqs": "8", "max_loras": "2", "max_cpu_loras": "2",
         "adapter_load_processes": "2"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader-exit")
    base = make_base(root / "base", "llama", seed=17)
    dirs = [write_random_adapter(root / f"d{i}", base, rank=8, targets=ALL, seed=60 + i) for i in range(6)]
    catalogue = root / "catalogue.json"
    catalogue.write_text(json.dumps({f"t{i}": str(dirs[i % len(dirs)]) for i in range(NAMES)}))
    return base, catalogue


def _loader_children(pid: int) -> list[int]:
    """The processes ``pid`` started with multiprocessing's spawn (its adapter loaders), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


def _files_of(loaders: list[int]) -> list[str]:
    return [p.name for pid in loaders for p in Path(choose_directory()).glob(f"{FILE_PREFIX}{pid}-*")]


def _busy_loading(model) -> tuple[EngineProcess, list[int]]:
    """An engine process whose loaders are loading: every request names another adapter."""
    base, catalogue = model
    process = EngineProcess(EngineLaunch(str(base), str(catalogue), "cpu", KNOBS))
    for i in range(NAMES):
        process.submit(GenerationRequest(f"r{i}", [0, 5, 6, 7], f"t{i}", SamplingParams(max_tokens=16)),
                       lambda out: None)
    deadline = time.monotonic() + 120
    while process.stats()["host_loads"] < 4:
        assert time.monotonic() < deadline, "the loader processes never loaded"
        time.sleep(0.05)
    assert process.stats()["host_loading"] > 0, "no load in flight: nothing to stop"
    loaders = _loader_children(process.info["pid"])
    assert len(loaders) == 2, loaders
    return process, loaders


def test_a_stop_with_loads_in_flight_exits_cleanly_with_its_loaders(model):
    process, loaders = _busy_loading(model)
    process.shutdown()
    # a stop that waits on its loaders for ever ends by the exit watchdog, with code 1
    assert process._process.exitcode == 0
    assert not [pid for pid in loaders if process_alive(pid)], "loader processes outlived the engine process"
    assert not _files_of(loaders), "packed files left behind"


def test_the_loaders_of_a_killed_engine_process_exit_and_leave_no_file(model):
    process, loaders = _busy_loading(model)
    os.kill(process.info["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while [pid for pid in loaders if process_alive(pid)]:
        assert time.monotonic() < deadline, "loader processes outlived their killed engine process"
        time.sleep(0.05)
    left = _files_of(loaders)
    process.shutdown()
    assert not left, f"packed files left behind: {left}"

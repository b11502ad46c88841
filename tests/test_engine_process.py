"""manylora.engine.scheduling.engine_process: the engine in a child process gives exactly what the engine in-process
gives, and
cancellation, refusals, calls, observer events, a failed start and a dead child all behave."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from manylora.engine.config import EngineConfig
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from manylora.engine.scheduling.engine_process import EngineFailedToStart, EngineLaunch, EngineProcess
from manylora.engine.scheduling.offline import generate
from model_factory import make_adapter, make_base

KNOBS = {"max_model_len": "2048", "max_num_seqs": "8"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-process")
    base = make_base(root / "base", "llama", seed=11)
    adapters = {"a": str(make_adapter(base, root / "a", rank=4, targets=["q_proj", "v_proj"], seed=1)),
                "b": str(make_adapter(base, root / "b", rank=8, targets=["o_proj", "up_proj"], seed=2))}
    catalogue = root / "catalogue.json"
    catalogue.write_text(json.dumps(adapters))
    return base, adapters, catalogue


class Recorder:
    """An observer that keeps every event."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        for name in ("request_arrived", "request_failed", "first_token", "request_finished", "adapter_loaded"):
            setattr(self, name, lambda *args, _name=name: self.events.append((_name, *args)))


@pytest.fixture(scope="module")
def engine(model):
    base, _, catalogue = model
    recorder = Recorder()
    process = EngineProcess(EngineLaunch(str(base), str(catalogue), "cpu", KNOBS), observer=recorder)
    process.recorder = recorder
    yield process
    process.shutdown()


def _requests(seed: int, n: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=rng.randint(1, 20))
        if rng.random() < 0.5:
            params = SamplingParams(max_tokens=params.max_tokens, temperature=1.1, top_k=30, seed=rng.randrange(99))
        out.append(GenerationRequest(f"q{seed}-{i}", [0] + [rng.randrange(4, 290) for _ in range(rng.randint(1, 12))],
                                     rng.choice([None, "a", "b"]), params, stream=rng.random() < 0.6))
    return out


def _collector():
    """A list of a request's outputs, an event set at its last, and the emit that fills both."""
    outputs: list[GenerationOutput] = []
    done = threading.Event()

    def emit(out: GenerationOutput) -> None:
        outputs.append(out)
        if out.finished:
            done.set()

    return outputs, done, emit


def test_outputs_equal_the_engine_in_process(model, engine):
    base, adapters, _ = model
    seed = random.randrange(2**32)
    requests = _requests(seed, 16)
    local = Engine(EngineConfig.from_strings(KNOBS, model_dir=str(base), adapters=adapters, device="cpu"))
    try:
        expected = generate(local, requests)
    finally:
        local.shutdown()
    got = generate(engine, requests)
    for e, g in zip(expected, got, strict=True):
        assert (g.token_ids, g.finish_reason, g.error) == (e.token_ids, e.finish_reason, None), f"seed {seed}"
        assert g.chunks[-1].adapter_sha256 == e.chunks[-1].adapter_sha256


def test_stream_interval_gathers_tokens_into_fewer_responses(model):
    base, _, catalogue = model
    ids = [0, 40, 41, 42]
    counts = {}
    for interval in ("0", "10000"):
        process = EngineProcess(EngineLaunch(str(base), str(catalogue), "cpu",
                                             {**KNOBS, "stream_interval_ms": interval}))
        try:
            [result] = generate(process, [GenerationRequest(f"s{interval}", ids, None,
                                                            SamplingParams(max_tokens=24, ignore_eos=True))])
        finally:
            process.shutdown()
        assert len(result.token_ids) == 24
        counts[interval] = [len(c.token_ids) for c in result.chunks]
    assert sum(counts["0"]) == sum(counts["10000"]) == 24
    assert len(counts["0"]) >= 10  # a response whenever the text is whole again (mostly one per token)
    # the first whole piece of text at once, the rest with the end. Outputs that wait for a busy delivery thread merge
    # (delivery.py), so interval 0's first response holds that piece and maybe the next ones
    assert len(counts["10000"]) == 2 and counts["10000"][0] <= counts["0"][0]


def test_refusals_come_back_as_error_outputs_and_are_counted(engine):
    before = engine.stats()["errors"]
    [unknown] = generate(engine, [GenerationRequest("u", [0, 5], "nope", SamplingParams(max_tokens=3))])
    assert unknown.error.code is ErrorCode.NOT_FOUND and "unknown adapter 'nope'" in unknown.error.message
    engine.count_refusal("a", ErrorCode.INVALID_ARG)
    deadline = time.monotonic() + 5
    while engine.stats()["errors"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["errors"] == before + 2
    assert {a["name"] for a in engine.list_adapters()} == {"a", "b"}
    with pytest.raises(RequestError) as off:
        engine.load_adapter("c", "/nowhere")
    assert off.value.code is ErrorCode.UNSUPPORTED


def test_the_observer_hears_the_childs_events(engine):
    engine.recorder.events.clear()
    generate(engine, [GenerationRequest("o", [0, 5, 6], "a", SamplingParams(max_tokens=5, ignore_eos=True))])
    deadline = time.monotonic() + 5
    while not any(e[0] == "request_finished" for e in engine.recorder.events) and time.monotonic() < deadline:
        time.sleep(0.02)
    # late failures of the test before; the adapter's load, which comes first unless a test before used it
    names = [e[0] for e in engine.recorder.events if e[0] != "request_failed" and not e[0].startswith("adapter_")]
    assert names[:2] == ["request_arrived", "first_token"] and "request_finished" in names
    finished = next(e for e in engine.recorder.events if e[0] == "request_finished")
    assert finished[1:5] == ("a", 3, 5, "length") and finished[5] > 0


def test_a_cancelled_flag_here_stops_the_request_there(engine):
    flag = threading.Event()
    outputs, done, emit = _collector()
    engine.submit(GenerationRequest("c", [0, 7], None, SamplingParams(max_tokens=2000, ignore_eos=True), stream=True,
                                    is_cancelled=flag.is_set), emit)
    while not outputs:
        time.sleep(0.005)
    flag.set()
    assert done.wait(2.0), "not cancelled within 2 s"
    assert outputs[-1].error is not None and outputs[-1].error.code is ErrorCode.CANCELLED
    assert sum(len(o.token_ids) for o in outputs) < 2000


class _Callable:
    """A cancellation flag or an emit callback that can be watched with a weak reference (as a Triton response
    sender behind them must be freed once its request is done: Triton releases the request only then)."""

    def __init__(self, result=None) -> None:
        self.result = result
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.result


def test_a_finished_request_leaves_no_reference_to_its_flag_or_callback(engine):
    flag, emit = _Callable(False), _Callable()
    engine.submit(GenerationRequest("w", [0, 7], None, SamplingParams(max_tokens=2000, ignore_eos=True), stream=True,
                                    is_cancelled=flag), emit)
    deadline = time.monotonic() + 30
    while not (emit.calls and flag.calls >= 2) and time.monotonic() < deadline:  # streaming, its flag polled
        time.sleep(0.005)
    engine.cancel("w")  # it ends between two polls of its flag, as a request mostly does
    calls = emit.calls
    while emit.calls == calls and time.monotonic() < deadline:
        time.sleep(0.005)
    refs = weakref.ref(flag), weakref.ref(emit)
    del flag, emit
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(r() is None for r in refs), "a finished request's flag or emit callback is still referenced"


def test_a_failed_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineFailedToStart) as failed:
        EngineProcess(EngineLaunch(str(tmp_path), None, "cpu", {}))
    assert "config" in str(failed.value).lower() or "tokenizer" in str(failed.value).lower()


def test_a_dead_child_fails_what_is_in_flight_and_refuses_more(model):
    base, _, catalogue = model
    process = EngineProcess(EngineLaunch(str(base), str(catalogue), "cpu", KNOBS))
    outputs, done, emit = _collector()
    process.submit(GenerationRequest("d", [0, 7], None, SamplingParams(max_tokens=2000, ignore_eos=True), stream=True),
                   emit)
    while not outputs:
        time.sleep(0.005)
    os.kill(process.info["pid"], signal.SIGKILL)
    assert done.wait(10)
    assert outputs[-1].error.code is ErrorCode.UNAVAILABLE and "engine process exited" in outputs[-1].error.message
    with pytest.raises(RequestError) as refused:
        process.submit(GenerationRequest("e", [0, 7], None, SamplingParams(max_tokens=2)), emit)
    assert refused.value.code is ErrorCode.UNAVAILABLE
    with pytest.raises(RequestError):
        process.stats()
    process.shutdown()


def test_an_exit_that_stalls_writes_the_stacks_and_ends():
    """The engine child's exit watchdog: a process whose exit waits for a thread that never ends (as a stuck
    shutdown would) writes that thread's stack to stderr and exits with code 1 once the watchdog's time is up."""
    code = """
import threading
from manylora.engine.scheduling.engine_process import arm_exit_watchdog

def waits_for_ever():
    threading.Event().wait()

threading.Thread(target=waits_for_ever, name="stuck").start()  # not a daemon: the interpreter's exit waits for it
arm_exit_watchdog(1.0)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "waits_for_ever" in done.stderr


def test_the_parent_side_needs_no_torch(model):
    """The Triton stub holds only the parent side: it imports neither torch nor the engine."""
    base, _, catalogue = model
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch here fails
from manylora.engine.scheduling.engine_process import EngineLaunch, EngineProcess
from manylora.engine.requests.types import GenerationRequest, SamplingParams
p = EngineProcess(EngineLaunch({str(base)!r}, {str(catalogue)!r}, "cpu", {KNOBS!r}))
print(p.stats()["device"])
p.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "cpu"
    assert "engine stopped in" in done.stderr and "on shutdown" not in done.stderr  # a clean exit, code 0

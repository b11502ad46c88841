"""What the Python models hand to Triton's response sender: only the outputs a request asked for, and no tensors in
the generator's answer to postprocessing's cancel (a BLS request). The 2.51 stub drops unrequested outputs, and turns
a BLS response's tensors into numpy arrays, without the GIL, which corrupts its heap (docs/security.md).

The models' own code, run against a recording stand-in for ``triton_python_backend_utils`` (no server is involved:
tests/e2e/test_e2e_attacks.py sends the same requests to the real one)."""

from __future__ import annotations

import importlib.util
import queue
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from manylora.engine.requests.response_tensors import GENERATOR_OUTPUTS
from manylora.engine.requests.types import GenerationOutput
from model_factory import train_tokenizer

REPO = Path(__file__).resolve().parents[1]
FINAL = 1
POSTPROCESSING_OUTPUTS = ["text_output", "lora_version_out", "num_input_tokens_out", "num_output_tokens_out",
                          "finish_reason_out"]


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self.array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Response:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.names = [t.name() for t in output_tensors]
        self.error = error


class _Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[list[str] | None, int]] = []  # (output names, or None for the flag alone; flags)

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((None if response is None else response.names, flags))


class _Request:
    def __init__(self, inputs: dict[str, np.ndarray], requested: list[str]) -> None:
        self.inputs, self.requested = inputs, requested

    def requested_output_names(self) -> list[str]:
        return self.requested


def _pb_utils() -> types.ModuleType:
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor, module.InferenceResponse = _Tensor, _Response
    module.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    module.get_input_tensor_by_name = lambda request, name: (
        _Tensor(name, request.inputs[name]) if name in request.inputs else None)
    module.Logger = types.SimpleNamespace(log_error=print, log_warn=print, log_info=print)
    return module


def _load(model: str, monkeypatch) -> types.ModuleType:
    folder = REPO / "model_repository" / model / "1"
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(f"stub_model_{model}", folder / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def postprocessing(monkeypatch):
    module = _load("postprocessing", monkeypatch)
    model = module.TritonPythonModel.__new__(module.TritonPythonModel)
    model.tokenizer = train_tokenizer()
    model.sends = [queue.SimpleQueue() for _ in range(module.SENDER_THREADS)]  # drained by the test, no threads
    return model


def _step(tokenizer) -> dict[str, np.ndarray]:
    ids = tokenizer.encode("the baker opens the shop").ids
    return {"request_key": np.array([[b"k"]], np.object_), "output_ids": np.array([ids[2:]], np.int32),
            "context_ids": np.array([ids[:2]], np.int32), "strip_chars": np.array([[0]], np.int32),
            "lora_version": np.array([[b""]], np.object_)}


@pytest.mark.parametrize("requested", [["text_output"], ["finish_reason_out", "text_output"], []])
def test_postprocessing_builds_only_the_requested_outputs(postprocessing, requested):
    response = postprocessing._one(_Request(_step(postprocessing.tokenizer), requested))
    assert sorted(response.names) == sorted(requested or POSTPROCESSING_OUTPUTS)  # none named: Triton means all


@pytest.fixture
def generator(monkeypatch):
    return _load("generator", monkeypatch)


@pytest.mark.parametrize(("requested", "names"), [
    ({"output_ids"}, ["output_ids"]),
    ({"output_ids", "request_key"}, ["output_ids", "request_key"]),
    (set(), [*GENERATOR_OUTPUTS, "request_key"]),
])
def test_a_keepalive_request_gets_its_key_only_when_it_asked_for_it(generator, requested, names):
    """A client may set keepalive on a direct generator request (preprocessing does inside the ensemble)."""
    sender = _Sender()
    emit = generator._Emitter(sender, frozenset(requested), "key", forget=lambda key: None)
    emit(GenerationOutput("r", [5, 6], [4]))
    emit(GenerationOutput("r", [], [], heartbeat=True))
    emit(GenerationOutput("r", [7], [6], finished=True, finish_reason="length"))
    heartbeat = [n for n in names if n == "request_key"]
    assert sender.sent == [(names, 0), (heartbeat, 0), (names, FINAL)]


def test_the_cancel_is_answered_with_the_final_flag_alone(generator):
    cancelled = []
    model = generator.TritonPythonModel.__new__(generator.TritonPythonModel)
    model._keys_lock, model._keys = threading.Lock(), {"k1": "req#1"}
    model.engine = types.SimpleNamespace(cancel=lambda request_id, why: cancelled.append(request_id))
    for requested in (frozenset(), frozenset({"control_output"})):
        sender = _Sender()
        model._control({"op": "cancel", "key": "k1"}, sender, requested)
        assert sender.sent == [(None, FINAL)]
    assert cancelled == ["req#1", "req#1"]


class _StepRequest(_Request):
    """A postprocessing step request that counts how often it is asked whether its stream was cancelled."""

    def __init__(self, inputs: dict[str, np.ndarray], cancelled: bool = False) -> None:
        super().__init__(inputs, ["text_output"])
        self.cancelled, self.asked, self.sender = cancelled, 0, _Sender()

    def get_response_sender(self) -> _Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


def test_postprocessing_asks_about_cancellation_sparingly_and_never_on_a_last_chunk(postprocessing):
    """Asking costs a round trip to the server: a stream is asked on its first chunk and on heartbeats, not again
    within CANCEL_CHECK_S, and not on its last chunk (a finish reason: the generator is done with it), after which
    it is forgotten. A cancelled stream's chunk makes no response (the final flag alone) and cancels its key."""
    tokenizer = postprocessing.tokenizer
    cancels: list[bytes] = []
    postprocessing._cancel = cancels.append

    def step(key: bytes, reason: bytes | None = None, heartbeat: bool = False, cancelled: bool = False):
        inputs = {"request_key": np.array([[key]], np.object_)} if heartbeat else {
            **_step(tokenizer), "request_key": np.array([[key]], np.object_)}
        if reason is not None:
            inputs["finish_reason"] = np.array([[reason]], np.object_)
        return _StepRequest(inputs, cancelled)

    first, second, last = step(b"a", b""), step(b"a", b""), step(b"a", b"length")
    again = step(b"a", b"")  # the same key after its last chunk: asked afresh
    beat, gone = step(b"b", heartbeat=True), step(b"c", b"", cancelled=True)
    late_last = step(b"c", b"stop", cancelled=True)  # a cancelled stream's last chunk still goes out
    requests = [first, second, last, again, beat, gone, late_last]
    postprocessing.execute(requests)
    for q in postprocessing.sends:
        q.put(None)
        postprocessing._send_loop(q)
    assert [r.asked for r in requests] == [1, 0, 0, 1, 1, 1, 0]
    assert cancels == [b"c"]
    assert gone.sender.sent == [(None, FINAL)] and beat.sender.sent == [(None, FINAL)]
    for r in (first, second, last, again, late_last):
        assert r.sender.sent == [(["text_output"], FINAL)]

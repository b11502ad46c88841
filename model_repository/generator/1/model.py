"""generator: Triton requests -> engine calls and engine outputs -> Triton responses.

Decoupled. execute() hands each request to the engine and returns at once; the engine
thread calls emit() for every chunk, and emit() sends it on the request's response sender
(FINAL on the last). Errors are per request: one bad request never fails its batch.

Request tensors (and Triton request parameters) become a GenerationRequest in
manylora/engine/requests/parsing.py (plain Python, fuzzed). Control requests (`control` = JSON):
list_adapters, stats, model_info, load_adapter, unload_adapter, cancel; load/unload need
MANYLORA_ALLOW_RUNTIME_ADAPTERS=1 in the server's environment (the engine's RequestError code
and message come back as the Triton error otherwise). All but cancel wait for the engine process,
so they run on control threads and execute() never waits for them.

Cancellation through the `llm` ensemble: Triton 2.51 does not tell a step that is already running
that its ensemble request was cancelled (a gRPC cancel, a closed HTTP stream); it marks only the
requests it makes for later steps. So a request with `keepalive` set (preprocessing sets it inside
the ensemble) carries an unguessable `request_key` on every response, gets a heartbeat response
(only `request_key`) after KEEPALIVE_S without output (a queued one when its turn comes among a bounded number
a second: manylora/engine/scheduling/heartbeats.py), and postprocessing, which sees the
cancelled flag on the step request such a response makes, sends {"op": "cancel", "key": ...} back.
Metrics: generator_metrics.MetricsObserver (pb_utils.MetricFamily), the engine's observer.

The engine process is launched with this stub's parent (tritonserver) as its host (EngineLaunch.host_pid): Triton
2.51 can leave this stub behind when it exits without unloading the model, its threads waiting on the gone server
forever (with the GIL held, so no thread here could notice), and the engine process ends it and stops itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import os
import secrets
import signal
import threading
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils
from generator_metrics import MetricsObserver, StatsPoller
from generator_metrics import close as close_metrics

from manylora.engine.devices import instance_device
from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.repository_paths import model_parameters
from manylora.engine.requests.model_info import model_info
from manylora.engine.requests.parsing import decode_text, parse_control, parse_generation
from manylora.engine.requests.response_tensors import is_requested, output_arrays
from manylora.engine.requests.types import GenerationOutput
from manylora.engine.scheduling.engine_process import EngineFailedToStart, EngineLaunch, EngineProcess

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# config.pbtxt parameters that are not EngineConfig fields: the checkpoint, the catalogue, the
# device (resolved here) and the model file's own settings (metrics)
NOT_ENGINE_FIELDS = ("base_model", "adapters", "device", "metrics_adapter_labels")
INPUTS = ("input_ids", "max_tokens", "lora_name", "stream", "temperature", "top_k", "top_p", "seed", "stop",
          "ignore_eos")
DEFAULT_ADAPTER_LABELS = 100
CONTROL_THREADS = 4  # control requests other than cancel wait for the engine process: they run off execute()
KEEPALIVE_S = 0.25  # a keepalive request's longest silence: how soon an ensemble cancellation is seen
ERROR_DELAY_S = 0.2  # a keepalive request's error after earlier responses waits this long (_Emitter)


def _triton_error(code: ErrorCode | str, message: str):
    name = code.value if isinstance(code, ErrorCode) else str(code)
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, name, pb_utils.TritonError.INTERNAL))


def _inputs(request) -> dict[str, np.ndarray]:
    """The request's tensors as numpy arrays (with the batch dimension), by input name."""
    arrays = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def _parameters(parameters: dict) -> dict[str, str]:
    values = {k: v.get("string_value", "") for k, v in parameters.items()}
    unset = [k for k, v in values.items() if "${" in v]
    if unset:
        raise pb_utils.TritonModelException(
            f"generator: parameters {unset} are not filled in; render the repository with scripts/serve.py"
        )
    return values


def engine_launch(parameters: dict, instance_kind: str = "", device_id: str | int | None = None) -> EngineLaunch:
    """config.pbtxt parameters (and the instance's placement) -> what the engine process is built from; empty
    values keep the engine's defaults (the engine process reads the catalogue and checks the knobs)."""
    values = _parameters(parameters)
    if not values.get("base_model"):
        raise pb_utils.TritonModelException("generator: parameter 'base_model' (a checkpoint directory) is empty")
    knobs = {k: v for k, v in values.items() if v and k not in NOT_ENGINE_FIELDS}
    return EngineLaunch(model_dir=values["base_model"], catalogue_file=values.get("adapters") or None,
                        device=instance_device(values.get("device") or "auto", instance_kind, device_id), knobs=knobs,
                        host_pid=os.getppid())


def adapter_label_limit(parameters: dict) -> int:
    raw = _parameters(parameters).get("metrics_adapter_labels", "").strip()
    if not raw:
        return DEFAULT_ADAPTER_LABELS
    try:
        limit = int(raw)
    except ValueError:
        message = f"generator: metrics_adapter_labels must be an integer, got {raw!r}"
        raise pb_utils.TritonModelException(message) from None
    if limit < 0:
        raise pb_utils.TritonModelException(f"generator: metrics_adapter_labels must be >= 0, got {limit}")
    return limit


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        # a crash of this stub (a signal in native code) otherwise shows only as "Stub process is not
        # healthy" on the requests: write every thread's Python stack to the server's log instead
        faulthandler.enable(all_threads=True)
        # `kill -USR1 <stub pid>` writes every thread's stack too (a hung stub is also "not healthy")
        with contextlib.suppress(ValueError, AttributeError, RuntimeError):  # not the main thread / no SIGUSR1
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        parameters = model_parameters(json.loads(args["model_config"]).get("parameters", {}), args["model_repository"])
        launch = engine_launch(parameters, args.get("model_instance_kind", ""), args.get("model_instance_device_id"))
        self.model_dir = launch.model_dir
        self.metrics = self._create_metrics(adapter_label_limit(parameters))
        self.poller: StatsPoller | None = None
        try:
            self.engine = EngineProcess(launch, observer=self.metrics)
        except (EngineFailedToStart, OSError) as e:
            # the message names the adapter (a pinned sha256 that does not match, a bad catalogue entry)
            pb_utils.Logger.log_error(f"generator: engine failed to start: {e}")
            # finalize() does not run after a failed start: drop the metrics in the order the backend needs now
            # (left to the garbage collector, they crashed the stub on its way out)
            close_metrics(self.metrics)
            raise pb_utils.TritonModelException(f"generator: engine failed to start: {e}") from e
        info = self.engine.info
        pb_utils.Logger.log_info(
            f"generator: engine process {info['pid']} serving on {info['device']} ({info['dtype']}) with "
            f"{info['adapters']} adapters (runtime adapter updates {'on' if info['runtime_adapters'] else 'off'}, "
            f"custom metrics {'registered' if self.metrics else 'off'})")
        if self.metrics is not None:
            self.poller = StatsPoller(self.engine.stats, self.metrics, 0.5, pb_utils.Logger.log_warn).start()
        self._ids = itertools.count()
        self._execute_sizes: Counter[int] = Counter()  # requests per execute() call: is Triton batching?
        self._keys: dict[str, str] = {}  # request key -> engine request id, for keepalive requests in flight
        self._keys_lock = threading.Lock()
        self._control_pool = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="manylora-control")

    @staticmethod
    def _create_metrics(adapter_labels: int) -> MetricsObserver | None:
        try:
            return MetricsObserver(pb_utils, adapter_labels, on_error=pb_utils.Logger.log_warn)
        except Exception as e:  # noqa: BLE001 - metrics off (--allow-metrics=false): serve without them
            pb_utils.Logger.log_warn(f"generator: custom metrics unavailable, running without them ({e})")
            return None

    def execute(self, requests: list) -> None:
        self._execute_sizes[len(requests)] += 1
        for request in requests:
            sender = None
            try:
                sender = request.get_response_sender()
                self._submit(request, sender)
            except RequestError as e:
                self._fail(sender, e.code, e.message)
            except Exception as e:  # noqa: BLE001 - never let one request fail the batch
                pb_utils.Logger.log_error(f"generator: {traceback.format_exc()}")
                self._fail(sender, ErrorCode.INTERNAL, f"generator failed: {e}")
        return None

    def finalize(self) -> None:
        stopped = self.poller is None or self.poller.stop(timeout=5.0)
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
        if stopped:  # a poll still under way would use the metrics as they are dropped: leave them then
            close_metrics(self.metrics)

    def _submit(self, request, sender) -> None:
        requested = frozenset(request.requested_output_names())
        control = pb_utils.get_input_tensor_by_name(request, "control")
        if control is not None:
            command = parse_control(control.as_numpy())
            if command["op"] == "cancel":  # no round trip to the engine process
                self._control(command, sender, requested)
            else:  # stats, adapter loads: execute() does not wait for them (a router may ask for stats often)
                self._control_pool.submit(self._control_answered, command, sender, requested)
            return
        inputs = _inputs(request)
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        try:
            refusal = pb_utils.get_input_tensor_by_name(request, "refusal")
            if refusal is not None:  # preprocessing refused it; the refusal is counted here, with the rest
                raise RequestError(ErrorCode.INVALID_ARG, decode_text("refusal", refusal.as_numpy().reshape(-1)[0]))
            keepalive = _keepalive(request)
            gen = parse_generation(inputs, request_id, None if keepalive else sender.is_cancelled,
                                   _request_parameters(request), require_max_tokens=keepalive)
        except RequestError as e:  # the engine never saw it: count it there all the same
            self.engine.count_refusal(_adapter_name(inputs), e.code)
            raise
        key = None
        if keepalive:
            gen.keepalive_s = KEEPALIVE_S
            key = secrets.token_urlsafe(24)
            with self._keys_lock:
                self._keys[key] = request_id
        try:
            self.engine.submit(gen, _Emitter(sender, requested, key, self._forget))
        except RequestError:
            self._forget(key)
            raise

    def _forget(self, key: str | None) -> None:
        if key is not None:
            with self._keys_lock:
                self._keys.pop(key, None)

    def _control_answered(self, command: dict, sender, requested: frozenset[str]) -> None:
        """_control on a control thread: every failure becomes the request's error response."""
        try:
            self._control(command, sender, requested)
        except RequestError as e:
            self._fail(sender, e.code, e.message)
        except Exception as e:  # noqa: BLE001 - the request gets the error, the thread goes on
            pb_utils.Logger.log_error(f"generator: {traceback.format_exc()}")
            self._fail(sender, ErrorCode.INTERNAL, f"generator failed: {e}")

    def _control(self, command: dict, sender, requested: frozenset[str]) -> None:
        op = command["op"]
        if op == "list_adapters":
            result = {"adapters": self.engine.list_adapters()}
        elif op == "model_info":  # manylora/engine/requests/model_info.py
            result = model_info(self.model_dir, self.engine.info.get("max_model_len"))
        elif op == "stats":
            sizes = sorted(self._execute_sizes.items())
            result = {**self.engine.stats(), "execute_batch_sizes": {str(k): v for k, v in sizes}}
        elif op == "load_adapter":
            result = self.engine.load_adapter(
                command["name"], command["path"], sha256=command["sha256"], replace=command["replace"]
            )
        elif op == "unload_adapter":
            result = self.engine.unload_adapter(command["name"])
        elif op == "cancel":  # from postprocessing: its ensemble request was cancelled (module docstring)
            with self._keys_lock:
                request_id = self._keys.get(command["key"])
            if request_id is not None:
                self.engine.cancel(request_id, "cancelled by the client")
            # the answer is the final flag alone: postprocessing asks through BLS, and the Triton 2.51 stub turns a
            # BLS response's tensors into numpy arrays on a thread without the GIL, corrupting its heap
            sender.send(flags=FINAL)
            return
        else:  # parse_control knows the ops
            raise RequestError(ErrorCode.INVALID_ARG, f"unknown control op {op!r}")
        tensors = []
        if is_requested("control_output", requested):  # never one the stub would prune (response_tensors.py)
            payload = np.array([[json.dumps(result).encode("utf-8")]], dtype=np.object_)
            tensors.append(pb_utils.Tensor("control_output", payload))
        sender.send(pb_utils.InferenceResponse(tensors), flags=FINAL)

    @staticmethod
    def _fail(sender, code: ErrorCode | str, message: str) -> None:
        if sender is None:
            return
        try:
            sender.send(pb_utils.InferenceResponse(error=_triton_error(code, message)), flags=FINAL)
        except Exception:  # noqa: BLE001 - the sender may already be closed
            pb_utils.Logger.log_error(f"generator: could not send error: {traceback.format_exc()}")


def _request_parameters(request) -> dict:
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (TypeError, ValueError):
        parameters = None
    if not isinstance(parameters, dict):
        raise RequestError(ErrorCode.INVALID_ARG, "request parameters are not a JSON object")
    return parameters


def _keepalive(request) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, "keepalive")
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[:1].all())


def _adapter_name(inputs: dict) -> str | None:
    """The adapter a refused request named, for its error count's label (None if unreadable)."""
    try:
        raw = inputs["lora_name"].reshape(-1)[0]
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except Exception:  # noqa: BLE001 - absent or malformed: the count goes to "base"
        return None


class _Emitter:
    """emit() for one request: called from the engine thread with each GenerationOutput; sends only
    the outputs the request asked for (manylora/engine/requests/response_tensors.py says why), and for a keepalive
    request its key on every response and a response of the key alone for each heartbeat.

    A keepalive request's error after earlier responses goes out with care: in Triton 2.51 an error
    from a step of an ensemble request while another of its steps is in flight (postprocessing of an
    earlier response) leaves the ensemble request in flight for good (its step count is no longer
    kept once the status is an error). So a cancelled keepalive request ends with FINAL alone (its
    client is gone), and another error is sent ERROR_DELAY_S later, when postprocessing has had time
    to finish what came before.
    """

    def __init__(self, sender, requested: frozenset[str], key: str | None, forget) -> None:
        self.sender = sender
        self.requested = requested
        self.key = None if key is None else np.array([[key.encode("ascii")]], dtype=np.object_)
        self.forget = lambda: forget(key)
        self.sent = False

    def __call__(self, out: GenerationOutput) -> None:
        try:
            if out.error is not None:
                self.forget()
                self._send_error(out.error)
                return
            tensors = [] if out.heartbeat else [pb_utils.Tensor(name, array)
                                                for name, array in output_arrays(out, self.requested)]
            if self.key is not None and is_requested("request_key", self.requested):  # a client may set keepalive
                tensors.append(pb_utils.Tensor("request_key", self.key))
            if out.finished:
                self.forget()
            self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if out.finished else 0)
            self.sent = True
        except Exception:  # noqa: BLE001 - a closed or cancelled stream; the engine thread must go on
            pb_utils.Logger.log_error(f"generator: could not send output: {traceback.format_exc()}")

    def _send_error(self, error: RequestError) -> None:
        response = pb_utils.InferenceResponse(error=_triton_error(error.code, error.message))
        if self.key is None or not self.sent:
            self.sender.send(response, flags=FINAL)
        elif error.code is ErrorCode.CANCELLED:
            self.sender.send(flags=FINAL)
        else:
            threading.Timer(ERROR_DELAY_S, self._send_late, (response,)).start()

    def _send_late(self, response) -> None:
        try:
            self.sender.send(response, flags=FINAL)
        except Exception:  # noqa: BLE001 - the stream is gone
            pb_utils.Logger.log_error(f"generator: could not send error: {traceback.format_exc()}")

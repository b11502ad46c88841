"""generator: Triton requests -> engine calls and engine outputs -> Triton responses.

Decoupled. execute() hands each request to the engine and returns at once; the engine
thread calls emit() for every chunk, and emit() sends it on the request's response sender
(FINAL on the last). Errors are per request: one bad request never fails its batch.
"""

from __future__ import annotations

import itertools
import json
import traceback
from collections import Counter

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.catalogue import load_catalogue_file
from backend.config import EngineConfig
from backend.engine import Engine
from backend.errors import ErrorCode, RequestError
from backend.request import GenerationOutput, GenerationRequest, SamplingParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# config.pbtxt parameters that are not EngineConfig fields by the same name
NOT_ENGINE_FIELDS = ("base_model", "adapters", "device")
SAMPLING_INPUTS = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}


def _triton_error(code: ErrorCode | str, message: str):
    name = code.value if isinstance(code, ErrorCode) else str(code)
    return pb_utils.TritonError(message, getattr(pb_utils.TritonError, name, pb_utils.TritonError.INTERNAL))


def _array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _text(value, name: str) -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(ErrorCode.INVALID_ARG, f"{name} is not valid UTF-8 ({e})") from None


def _scalar(request, name: str):
    values = _array(request, name)
    if values is None:
        return None
    if values.size != 1:
        raise RequestError(ErrorCode.INVALID_ARG, f"{name} must hold one value, got {values.size}")
    return values[0]


def engine_config(parameters: dict) -> EngineConfig:
    """config.pbtxt parameters -> EngineConfig; empty values keep the engine's defaults."""
    values = {k: v.get("string_value", "") for k, v in parameters.items()}
    unset = [k for k, v in values.items() if "${" in v]
    if unset:
        raise pb_utils.TritonModelException(
            f"generator: parameters {unset} are not filled in; render the repository with scripts/serve.py"
        )
    if not values.get("base_model"):
        raise pb_utils.TritonModelException("generator: parameter 'base_model' (a checkpoint directory) is empty")
    device = values.get("device") or "auto"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    # name -> catalogue entry (path, optional pinned sha256), as the engine registers them
    adapters = load_catalogue_file(values["adapters"]) if values.get("adapters") else {}
    knobs = {k: v for k, v in values.items() if v and k not in NOT_ENGINE_FIELDS}
    return EngineConfig.from_strings(knobs, model_dir=values["base_model"], adapters=adapters, device=device)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = engine_config(json.loads(args["model_config"]).get("parameters", {}))
        pb_utils.Logger.log_info(f"generator: starting engine on {config.device} with {len(config.adapters)} adapters")
        self.engine = Engine(config)
        self._ids = itertools.count()
        self._execute_sizes: Counter[int] = Counter()  # requests per execute() call: is Triton batching?

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
        self.engine.shutdown()

    def _submit(self, request, sender) -> None:
        control = _scalar(request, "control")
        if control is not None:
            self._control(_text(control, "control"), sender)
            return
        prompt = _array(request, "input_ids")
        if prompt is None:
            raise RequestError(ErrorCode.INVALID_ARG, "input_ids is missing (or send 'control' for a control request)")
        kwargs = {}
        for name, cast in SAMPLING_INPUTS.items():
            value = _scalar(request, name)
            if value is not None:
                kwargs[name] = cast(value)
        stop = _array(request, "stop")
        if stop is not None:
            kwargs["stop"] = tuple(s for s in (_text(v, "stop") for v in stop) if s)
        adapter = _scalar(request, "lora_name")
        adapter = _text(adapter, "lora_name") if adapter is not None else ""
        stream = _scalar(request, "stream")
        gen = GenerationRequest(
            request_id=f"{request.request_id() or 'req'}#{next(self._ids)}",
            prompt_ids=[int(t) for t in prompt],
            adapter=adapter or None,
            sampling=SamplingParams(**kwargs),
            stream=bool(stream) if stream is not None else False,
            is_cancelled=sender.is_cancelled,
        )
        self.engine.submit(gen, _Emitter(sender))

    def _control(self, command: str, sender) -> None:
        try:
            op = json.loads(command).get("op")
        except (json.JSONDecodeError, AttributeError):
            message = f"control must be a JSON object with 'op', got {command!r}"
            raise RequestError(ErrorCode.INVALID_ARG, message) from None
        if op == "list_adapters":
            result = {"adapters": self.engine.list_adapters()}
        elif op == "stats":
            sizes = sorted(self._execute_sizes.items())
            result = {**self.engine.stats(), "execute_batch_sizes": {str(k): v for k, v in sizes}}
        else:
            raise RequestError(ErrorCode.INVALID_ARG, f"unknown control op {op!r}; known: list_adapters, stats")
        payload = np.array([[json.dumps(result).encode("utf-8")]], dtype=np.object_)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("control_output", payload)]), flags=FINAL)

    @staticmethod
    def _fail(sender, code: ErrorCode | str, message: str) -> None:
        if sender is None:
            return
        try:
            sender.send(pb_utils.InferenceResponse(error=_triton_error(code, message)), flags=FINAL)
        except Exception:  # noqa: BLE001 - the sender may already be closed
            pb_utils.Logger.log_error(f"generator: could not send error: {traceback.format_exc()}")


class _Emitter:
    """emit() for one request: called from the engine thread with each GenerationOutput."""

    def __init__(self, sender) -> None:
        self.sender = sender

    def __call__(self, out: GenerationOutput) -> None:
        try:
            if out.error is not None:
                response = pb_utils.InferenceResponse(error=_triton_error(out.error.code, out.error.message))
                self.sender.send(response, flags=FINAL)
                return
            version = (out.adapter_sha256 or "").encode("utf-8")
            response = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("output_ids", np.asarray(out.token_ids, dtype=np.int32).reshape(1, -1)),
                    pb_utils.Tensor("context_ids", np.asarray(out.context_ids, dtype=np.int32).reshape(1, -1)),
                    pb_utils.Tensor("strip_chars", np.array([[out.strip_chars]], dtype=np.int32)),
                    pb_utils.Tensor("lora_version", np.array([[version]], dtype=np.object_)),
                ]
            )
            self.sender.send(response, flags=FINAL if out.finished else 0)
        except Exception:  # noqa: BLE001 - a closed or cancelled stream; the engine thread must go on
            pb_utils.Logger.log_error(f"generator: could not send output: {traceback.format_exc()}")

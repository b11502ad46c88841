"""Triton request tensors -> GenerationRequest (or a RequestError that says what is wrong).

The generator model hands this module the numpy arrays of one request as Triton delivers
them (with the batch dimension: ``input_ids`` [1, n], ``max_tokens`` [1, 1], ...). Nothing
here imports ``triton_python_backend_utils``, so the translation is tested and fuzzed in a
plain process (tests/test_request_parsing.py). Every malformed input, whatever its dtype,
shape or bytes, ends in RequestError(INVALID_ARG) naming the input; never another exception.

Checks that need the model (vocabulary, context length, adapter names, queue) stay in
Engine.validate; the ones here need nothing but the request.

Request parameters (Triton's, not tensors: what an HTTP generate body's unknown keys become, and
what an ensemble forwards to every step) are refused unless known: a misspelled input such as
``lora_nme`` must not be served silently as the base model. ``sampling_parameters`` (a JSON object,
as the vLLM backend reads it) is understood; keys starting with ``triton_`` belong to the server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.types import GenerationRequest, SamplingParams

MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_NAME_CHARS = 256  # adapter names
MAX_CONTROL_BYTES = 64 * 1024
INT32_MAX = 2**31 - 1
MAX_PARAMETER_BYTES = 64 * 1024  # a sampling_parameters JSON string
CONTROL_OPS = ("list_adapters", "stats", "model_info", "load_adapter", "unload_adapter", "cancel")
SAMPLING_INPUTS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")
# sampling_parameters keys: the sampling inputs, and vLLM's that have one accepted value here
SAMPLING_PARAMETER_KEYS = (*SAMPLING_INPUTS, "n")
KNOWN_PARAMETERS = ("sampling_parameters", "exclude_input_in_output")


def _invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARG, message)


def _flat(name: str, value: Any) -> np.ndarray:
    """A request's tensor as a 1-D array; the batch dimension (1) and any size-1 axes go."""
    try:
        array = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - anything that is not array-like
        raise _invalid(f"{name}: not an array ({type(value).__name__}: {e})") from None
    if array.ndim > 0 and array.shape[0] != 1:
        raise _invalid(f"{name}: expected a batch of one request (shape [1, ...]), got shape {list(array.shape)}")
    if sum(1 for d in array.shape[1:] if d != 1) > 1:
        raise _invalid(f"{name}: expected shape [1, n], got {list(array.shape)}")
    return array.reshape(-1)


def _one(name: str, value: Any) -> Any:
    flat = _flat(name, value)
    if flat.size != 1:
        raise _invalid(f"{name} must hold one value, got {flat.size}")
    return flat[0]


def decode_text(name: str, value: Any) -> str:
    """A BYTES element as text: UTF-8 bytes (Triton's BYTES) or a str."""
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _invalid(f"{name} is not valid UTF-8 ({e})") from None
    if isinstance(value, str):
        return str(value)
    raise _invalid(f"{name} must be a string (BYTES), got {type(value).__name__}")


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _invalid(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise _invalid(f"{name} must be in [{low}, {high}], got {number}")
    return number


def _real(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _invalid(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise _invalid(f"{name} must be a finite number, got {number}")
    return number


def _boolean(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    raise _invalid(f"{name} must be a boolean, got {type(value).__name__} {value!r}")


def _prompt(value: Any) -> list[int]:
    ids = _flat("input_ids", value)
    if ids.dtype.kind not in "iu":
        raise _invalid(f"input_ids must be integers (INT32), got dtype {ids.dtype}")
    return [int(t) for t in ids.tolist()]


def _stop(value: Any) -> tuple[str, ...]:
    flat = _flat("stop", value)
    if flat.size > MAX_STOP_STRINGS:
        raise _invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {flat.size}")
    strings = []
    for item in flat.tolist():
        text = decode_text("stop", item)
        if len(text) > MAX_STOP_CHARS:
            raise _invalid(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got {len(text)}")
        if text:
            strings.append(text)
    return tuple(strings)


def sampling_params(inputs: Mapping[str, Any]) -> SamplingParams:
    """The sampling inputs present in ``inputs`` (absent ones keep SamplingParams' defaults)."""
    kwargs: dict[str, Any] = {}
    present = {k: v for k, v in inputs.items() if v is not None}
    if "max_tokens" in present:
        kwargs["max_tokens"] = _integer("max_tokens", _one("max_tokens", present["max_tokens"]), 1, INT32_MAX)
    if "temperature" in present:
        temperature = _real("temperature", _one("temperature", present["temperature"]))
        if temperature < 0:
            raise _invalid(f"temperature must be >= 0 (0: greedy), got {temperature}")
        kwargs["temperature"] = temperature
    if "top_k" in present:
        kwargs["top_k"] = _integer("top_k", _one("top_k", present["top_k"]), 0, INT32_MAX)
    if "top_p" in present:
        top_p = _real("top_p", _one("top_p", present["top_p"]))
        if not 0 < top_p <= 1:
            raise _invalid(f"top_p must be in (0, 1], got {top_p}")
        kwargs["top_p"] = top_p
    if "seed" in present:
        kwargs["seed"] = _integer("seed", _one("seed", present["seed"]), 0, 2**64 - 1)
    if "stop" in present:
        kwargs["stop"] = _stop(present["stop"])
    if "ignore_eos" in present:
        kwargs["ignore_eos"] = _boolean("ignore_eos", _one("ignore_eos", present["ignore_eos"]))
    return SamplingParams(**kwargs)


def _parameter_value(key: str, value: Any) -> np.ndarray:
    """A sampling_parameters value in the form the tensors take ([1, n] with the batch dimension)."""
    if key == "stop":
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise _invalid(f"sampling_parameters: 'stop' must be a string or a list of strings, got {value!r:.100}")
        return np.array([items or [""]], dtype=np.object_)
    if isinstance(value, (list, dict, str)) or value is None:
        raise _invalid(f"sampling_parameters: '{key}' must be a number or a boolean, got {value!r:.100}")
    return np.array([[value]], dtype=np.object_)


def parameter_inputs(parameters: Mapping[str, Any], inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The sampling inputs that a request's Triton parameters carry (``sampling_parameters``), as arrays; raises
    RequestError(INVALID_ARG) for an unknown parameter, an unknown or unsupported sampling key, or a value also
    given as an input tensor."""
    unknown = sorted(k for k in parameters if k not in KNOWN_PARAMETERS and not str(k).startswith("triton_"))
    if unknown:
        inputs_known = ", ".join(("text_input", "input_ids", "lora_name", "stream", *SAMPLING_INPUTS))
        raise _invalid(f"unknown parameter {unknown[0][:100]!r}: inputs are {inputs_known}; parameters are "
                       f"{', '.join(KNOWN_PARAMETERS)}")
    if "exclude_input_in_output" in parameters and parameters["exclude_input_in_output"] is not True:
        raise _invalid("exclude_input_in_output: only true is supported (outputs never repeat the prompt)")
    raw = parameters.get("sampling_parameters")
    if raw is None:
        return {}
    if not isinstance(raw, str) or len(raw) > MAX_PARAMETER_BYTES:
        raise _invalid(f"sampling_parameters must be a JSON object in a string of at most {MAX_PARAMETER_BYTES} "
                       f"bytes")
    try:
        values = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        values = None
    if not isinstance(values, dict):
        raise _invalid(f"sampling_parameters must be a JSON object, got {raw[:200]!r}")
    arrays: dict[str, np.ndarray] = {}
    for key, value in values.items():
        if key not in SAMPLING_PARAMETER_KEYS:
            raise _invalid(f"sampling_parameters: {key[:100]!r} is not supported; supported: "
                           f"{', '.join(SAMPLING_PARAMETER_KEYS)}")
        if key == "n":
            if value != 1 or isinstance(value, bool):
                raise _invalid(f"sampling_parameters: n must be 1 (one output per request), got {value!r:.100}")
            continue
        if inputs.get(key) is not None:
            raise _invalid(f"{key} is given twice: as an input and in sampling_parameters")
        arrays[key] = _parameter_value(key, value)
    return arrays


def parse_generation(
    inputs: Mapping[str, Any],
    request_id: str,
    is_cancelled: Callable[[], bool] | None = None,
    parameters: Mapping[str, Any] | None = None,
    require_max_tokens: bool = False,
) -> GenerationRequest:
    """One generate request's tensors (and Triton parameters) -> GenerationRequest; RequestError(INVALID_ARG) if
    malformed. Without ``require_max_tokens`` a request that gives no max_tokens gets SamplingParams' default."""
    if inputs.get("input_ids") is None:
        raise _invalid("input_ids is missing (or send 'control' for a control request)")
    prompt = _prompt(inputs["input_ids"])
    adapter = ""
    if inputs.get("lora_name") is not None:
        adapter = decode_text("lora_name", _one("lora_name", inputs["lora_name"]))
        if len(adapter) > MAX_NAME_CHARS:
            raise _invalid(f"lora_name: at most {MAX_NAME_CHARS} characters, got {len(adapter)}")
        if adapter and not adapter.strip():
            raise _invalid("lora_name is blank: name an adapter, or send no lora_name (or an empty one) for the "
                           "base model")
    stream = inputs.get("stream")
    sampling = {**inputs, **parameter_inputs(parameters or {}, inputs)}
    if require_max_tokens and sampling.get("max_tokens") is None:
        raise _invalid("max_tokens is missing: send the most tokens to generate as max_tokens")
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt,
        adapter=adapter or None,
        sampling=sampling_params(sampling),
        stream=_boolean("stream", _one("stream", stream)) if stream is not None else False,
        is_cancelled=is_cancelled,
    )


def parse_control(value: Any) -> dict:
    """The ``control`` input (one JSON object with "op") -> the validated command.

    list_adapters, stats, model_info: {"op"}. cancel: {"op", "key"} (a request key, see the generator).
    load_adapter: {"op", "name", "path", "sha256" (str or None),
    "replace" (bool)}. unload_adapter: {"op", "name"}.
    """
    raw = _one("control", value)
    if isinstance(raw, (bytes, np.bytes_)) and len(raw) > MAX_CONTROL_BYTES:
        raise _invalid(f"control: at most {MAX_CONTROL_BYTES} bytes, got {len(raw)}")
    text = decode_text("control", raw)
    try:
        command = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        command = None
    if not isinstance(command, dict) or not isinstance(command.get("op"), str):
        raise _invalid(f"control must be a JSON object with 'op', got {text[:200]!r}")
    op = command["op"]
    if op not in CONTROL_OPS:
        raise _invalid(f"unknown control op {op[:100]!r}; known: {', '.join(CONTROL_OPS)}")
    if op in ("list_adapters", "stats", "model_info"):
        return {"op": op}
    if op == "cancel":
        key = command.get("key")
        if not isinstance(key, str) or not key or len(key) > MAX_NAME_CHARS:
            raise _invalid(f"cancel: 'key' must be a request key string, got {key!r:.100}")
        return {"op": op, "key": key}
    name = command.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_CHARS:
        raise _invalid(f"{op}: 'name' must be a non-empty string of at most {MAX_NAME_CHARS} characters, got {name!r}")
    if op == "unload_adapter":
        return {"op": op, "name": name.strip()}
    path, sha256, replace = command.get("path"), command.get("sha256"), command.get("replace", False)
    if not isinstance(path, str) or not path:
        raise _invalid(f"load_adapter: 'path' (the adapter directory on the server) must be a string, got {path!r}")
    if sha256 is not None and not isinstance(sha256, str):
        raise _invalid(f"load_adapter: 'sha256' must be a hex string, got {sha256!r}")
    if not isinstance(replace, bool):
        raise _invalid(f"load_adapter: 'replace' must be true or false, got {replace!r}")
    return {"op": op, "name": name.strip(), "path": path, "sha256": sha256 or None, "replace": replace}

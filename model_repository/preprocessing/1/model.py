"""preprocessing: text_input -> input_ids with the checkpoint's tokenizer.json (special tokens added unless
add_special_tokens is false: a rendered chat template holds its own).

A prompt that cannot fit the context is refused before it is tokenized whole (manylora/engine/requests/prompt_guard.py),
so one huge text cannot hold the tokenizer while other requests wait. A request refused here is not
answered with an error: its `refusal` output (the message) goes on to the generator, which refuses it
there, so that every refusal is counted in one place (the engine's stats and the manylora metrics).
Inside the llm ensemble it also sets the generator's `keepalive` input (the generator's model.py says why).
"""

from __future__ import annotations

import ctypes
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from manylora.engine.errors import RequestError
from manylora.engine.model_config import ModelConfig
from manylora.engine.repository_paths import model_parameters
from manylora.engine.requests.detokenize import tokenizer_from_parameters
from manylora.engine.requests.prompt_guard import PromptGuard

TRIM_AFTER_BYTES = 1 << 20  # after a request this large, hand freed heap memory back to the system


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(json.loads(args["model_config"]).get("parameters", {}), args["model_repository"])
        try:
            tokenizer = tokenizer_from_parameters(params, "preprocessing")
            max_len = params.get("max_model_len", {}).get("string_value", "")
            context = int(max_len) if max_len.strip() else ModelConfig.from_dir(
                params["tokenizer_dir"]["string_value"]).max_position_embeddings
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise pb_utils.TritonModelException(f"preprocessing: {e}") from e
        self.guard = PromptGuard(tokenizer, context)
        self.trim = _malloc_trim()
        self.keepalive = np.array([[True]], dtype=np.bool_)

    def execute(self, requests: list) -> list:
        responses, largest = [], 0
        for request in requests:
            response, size = self._one(request)
            responses.append(response)
            largest = max(largest, size)
        if self.trim is not None and largest > TRIM_AFTER_BYTES:
            self.trim(0)  # the large text is gone: return its heap pages instead of keeping them
        return responses

    def _one(self, request) -> tuple[pb_utils.InferenceResponse, int]:
        """The response for one request, and the size of its text (bytes)."""
        tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
        if tensor is None:
            return self._refusal("text_input is missing: send the prompt as text_input"), 0
        size = 0
        try:
            raw = tensor.as_numpy().reshape(-1)[0]
            size = len(raw)
            if not size:
                raise ValueError("text_input is empty: the prompt needs at least one character")
            special = pb_utils.get_input_tensor_by_name(request, "add_special_tokens")
            add_special = special is None or bool(special.as_numpy().reshape(-1)[:1].all())
            ids = self.guard.encode(raw if isinstance(raw, bytes) else str(raw), add_special_tokens=add_special)
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1)),
                pb_utils.Tensor("keepalive", self.keepalive),
            ]), size
        except RequestError as e:
            return self._refusal(e.message), size
        except ValueError as e:
            return self._refusal(str(e)), size
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
            pb_utils.Logger.log_error(f"preprocessing: {e!r}")
            return _error(f"preprocessing failed: {e}", pb_utils.TritonError.INTERNAL), size

    def _refusal(self, message: str) -> pb_utils.InferenceResponse:
        """A response that carries the refusal on to the generator (module docstring)."""
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("input_ids", np.zeros((1, 0), dtype=np.int32)),
            pb_utils.Tensor("keepalive", self.keepalive),
            pb_utils.Tensor("refusal", np.array([[message.encode("utf-8")]], dtype=np.object_)),
        ])


def _error(message: str, code) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

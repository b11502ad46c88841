"""preprocessing: text_input -> input_ids with the checkpoint's tokenizer.json."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.detokenize import tokenizer_from_parameters


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        try:
            self.tokenizer = tokenizer_from_parameters(params, "preprocessing")
        except (ValueError, FileNotFoundError) as e:
            raise pb_utils.TritonModelException(str(e)) from e

    def execute(self, requests: list) -> list:
        return [self._one(request) for request in requests]

    def _one(self, request) -> pb_utils.InferenceResponse:
        try:
            raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            try:
                text = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            except UnicodeDecodeError as e:
                raise ValueError(f"text_input is not valid UTF-8 ({e})") from None
            if not text:
                raise ValueError("text_input is empty: the prompt needs at least one character")
            ids = self.tokenizer.encode(text, add_special_tokens=True).ids
            tensor = pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32).reshape(1, -1))
            return pb_utils.InferenceResponse(output_tensors=[tensor])
        except ValueError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG))
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
            pb_utils.Logger.log_error(f"preprocessing: {e!r}")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing failed: {e}"))

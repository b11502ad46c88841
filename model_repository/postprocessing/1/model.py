"""postprocessing: one generator chunk -> its text (correct across streamed chunks)."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.detokenize import decode_chunk, tokenizer_from_parameters


def _ids(request, name: str) -> list[int]:
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1).tolist()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        try:
            self.tokenizer = tokenizer_from_parameters(params, "postprocessing")
        except (ValueError, FileNotFoundError) as e:
            raise pb_utils.TritonModelException(str(e)) from e

    def execute(self, requests: list) -> list:
        return [self._one(request) for request in requests]

    def _one(self, request) -> pb_utils.InferenceResponse:
        try:
            strip = _ids(request, "strip_chars")
            text = decode_chunk(
                self.tokenizer, _ids(request, "output_ids"), _ids(request, "context_ids"), strip[0] if strip else 0
            )
            version = pb_utils.get_input_tensor_by_name(request, "lora_version").as_numpy().reshape(1, 1)
            return pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                    pb_utils.Tensor("lora_version_out", version.astype(np.object_)),
                ]
            )
        except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
            pb_utils.Logger.log_error(f"postprocessing: {e!r}")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing failed: {e}"))

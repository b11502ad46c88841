"""postprocessing: one generator chunk -> its text (correct across streamed chunks).

Decoupled: each request gets at most one response, then FINAL. The generator's token counts and finish
reason go on unchanged (PASSED_ON). A generator heartbeat (only
`request_key`, no tokens) gets none. For a request that Triton marked cancelled (its ensemble request
was cancelled: a gRPC cancel, a closed HTTP stream) the generator is told to stop that request
(control op "cancel" with the key), since Triton does not tell it; the request itself gets no
response either: an error response from this step to a cancelled ensemble request leaves the
ensemble request in flight for good in Triton 2.51 (the server then waits its whole exit timeout).
The generator's own CANCELLED error ends the ensemble request.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from manylora.engine.repository_paths import model_parameters
from manylora.engine.requests.detokenize import decode_chunk, tokenizer_from_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
GENERATOR = "generator"


# generator outputs that go on to the client unchanged, with their value when the generator sent none
PASSED_ON = {"num_input_tokens": np.zeros((1, 1), dtype=np.uint32),
             "num_output_tokens": np.zeros((1, 1), dtype=np.uint32),
             "finish_reason": np.array([[b""]], dtype=np.object_)}


def _array(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _passed_on(request, name: str, default: np.ndarray) -> np.ndarray:
    array = _array(request, name)
    return default if array is None else array.reshape(1, 1).astype(default.dtype)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(json.loads(args["model_config"]).get("parameters", {}), args["model_repository"])
        try:
            self.tokenizer = tokenizer_from_parameters(params, "postprocessing")
        except (ValueError, FileNotFoundError) as e:
            raise pb_utils.TritonModelException(str(e)) from e

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                response = self._one(request)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                pb_utils.Logger.log_error(f"postprocessing: {e!r}")
                response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing failed: {e}"))
            if response is None:
                sender.send(flags=FINAL)
            else:
                sender.send(response, flags=FINAL)
        return None

    def _one(self, request) -> pb_utils.InferenceResponse | None:
        key = _array(request, "request_key").reshape(-1)[0]
        if request.is_cancelled():
            self._cancel(key)
            return None
        output_ids = _array(request, "output_ids")
        if output_ids is None:  # a heartbeat: nothing to say
            return None
        strip = _array(request, "strip_chars")
        text = decode_chunk(self.tokenizer, output_ids.reshape(-1).tolist(),
                            _array(request, "context_ids").reshape(-1).tolist(),
                            int(strip.reshape(-1)[0]) if strip is not None else 0)
        version = _array(request, "lora_version")
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("lora_version_out", version.reshape(1, 1).astype(np.object_)),
            *(pb_utils.Tensor(f"{name}_out", _passed_on(request, name, default))
              for name, default in PASSED_ON.items()),
        ])

    @staticmethod
    def _cancel(key: bytes) -> None:
        """Tell the generator to stop the request with this key (a BLS control request)."""
        command = json.dumps({"op": "cancel", "key": key.decode("ascii")}).encode("utf-8")
        control = pb_utils.Tensor("control", np.array([[command]], dtype=np.object_))
        request = pb_utils.InferenceRequest(model_name=GENERATOR, inputs=[control], requested_output_names=[])
        for response in request.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"postprocessing: cancel not passed on: {response.error().message()}")

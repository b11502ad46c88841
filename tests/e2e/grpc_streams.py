"""One gRPC stream request against the test server, read to its final response: its error, or the output names
of its responses. For the attack and hostile-input tests."""

from __future__ import annotations

import queue

import numpy as np
import tritonclient.grpc as grpcclient


def grpc_input(name: str, array: np.ndarray):
    """A gRPC input of ``array``, its Triton type from its numpy dtype."""
    dtype = {"O": "BYTES", "i": "INT32", "f": "FP32", "b": "BOOL", "u": "UINT64"}[array.dtype.kind]
    if array.dtype == np.int64:
        dtype = "INT64"
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _responses(server, model: str, inputs: list, parameters: dict | None = None, outputs: list[str] | None = None):
    """Yield (result, error) of one stream request until its final response or its first error."""
    results: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        grpc.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=True,
                                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None)
        while True:
            result, error = results.get(timeout=120)
            yield result, error
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        grpc.stop_stream()
        grpc.close()


def stream_error(server, model: str, inputs: list, parameters: dict | None = None) -> str | None:
    """The error message of one gRPC stream request (None if it finished without one)."""
    for _, error in _responses(server, model, inputs, parameters):
        if error is not None:
            return error.message()
    return None


def stream_output_names(server, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[set[str]]:
    """The output names of each response (with outputs) of one gRPC stream request asking for ``outputs``."""
    names = []
    for result, error in _responses(server, model, [grpc_input(n, a) for n, a in inputs.items()], outputs=outputs):
        assert error is None, error.message()
        if result.get_response().outputs:
            names.append({o.name for o in result.get_response().outputs})
    return names

"""postprocessing: one generator chunk -> its text (correct across streamed chunks).

Decoupled: each request gets at most one response, then FINAL. The generator's token counts and finish
reason go on unchanged (PASSED_ON). A generator heartbeat (only
`request_key`, no tokens) gets none. For a request that Triton marked cancelled (its ensemble request
was cancelled: a gRPC cancel, a closed HTTP stream) the generator is told to stop that request
(control op "cancel" with the key), since Triton does not tell it; the request itself gets no
response either: an error response from this step to a cancelled ensemble request leaves the
ensemble request in flight for good in Triton 2.51 (the server then waits its whole exit timeout).
The generator's own CANCELLED error ends the ensemble request. It answers the cancel with the final flag alone,
and a response here holds only the outputs its request asked for: the 2.51 stub handles BLS response tensors and
unrequested outputs without the GIL (docs/security.md).

Speed: every chunk of every stream is a request here, and a response send waits for the server (an IPC round
trip). So execute() only decodes; the sends (and cancels) run on SENDER_THREADS threads, each request on the
thread its stream's `request_key` hashes to: a stream's chunks leave in the order they came, while sends of
different streams overlap. One instance only: two would reorder a stream's chunks.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import zlib

import numpy as np
import triton_python_backend_utils as pb_utils

from manylora.engine.repository_paths import model_parameters
from manylora.engine.requests.detokenize import decode_chunk, tokenizer_from_parameters
from manylora.engine.requests.response_tensors import is_requested

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
GENERATOR = "generator"
SENDER_THREADS = 8  # sends in flight at once, of different streams
CANCEL_CHECK_S = 0.2  # a stream with chunks flowing is asked whether it is cancelled at most this often


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
        self.sends = [queue.SimpleQueue() for _ in range(SENDER_THREADS)]
        self.senders = [threading.Thread(target=self._send_loop, args=(q,), name=f"postprocessing-send-{i}",
                                         daemon=True) for i, q in enumerate(self.sends)]
        for thread in self.senders:
            thread.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            key, final_chunk = b"", False
            try:
                key = _array(request, "request_key").reshape(-1)[0]
                reason = _array(request, "finish_reason")
                final_chunk = reason is not None and bool(reason.reshape(-1)[0])
                response = self._one(request)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                pb_utils.Logger.log_error(f"postprocessing: {e!r}")
                response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing failed: {e}"))
            self.sends[zlib.crc32(key) % SENDER_THREADS].put((request, sender, response, key, final_chunk))
        return None

    def finalize(self) -> None:
        for q in self.sends:
            q.put(None)
        for thread in self.senders:
            thread.join(5)

    def _send_loop(self, sends: queue.SimpleQueue) -> None:
        checked: dict[bytes, float] = {}  # this thread's streams: when each was last asked whether it is cancelled
        while (item := sends.get()) is not None:
            request, sender, response, key, final_chunk = item
            try:
                if self._cancelled(request, response, key, final_chunk, checked):
                    self._cancel(key)
                    sender.send(flags=FINAL)
                elif response is None:
                    sender.send(flags=FINAL)
                else:
                    sender.send(response, flags=FINAL)
            except Exception as e:  # noqa: BLE001 - a closed stream; the other streams go on
                pb_utils.Logger.log_error(f"postprocessing: could not send: {e!r}")

    @staticmethod
    def _cancelled(request, response, key: bytes, final_chunk: bool, checked: dict[bytes, float]) -> bool:
        """Whether the stream of this step request was cancelled. Asking costs a round trip to the server, so a
        stream is asked on a heartbeat (response None: that is what it is for) and otherwise at most every
        CANCEL_CHECK_S; its last chunk (one with a finish reason) is not asked, since the generator is done with
        it, and the stream is forgotten."""
        if final_chunk:
            checked.pop(key, None)
            return False
        now = time.monotonic()
        if response is not None:
            last = checked.get(key)
            if last is not None and now - last < CANCEL_CHECK_S:
                return False
        if len(checked) > 4096:  # streams that ended with an error (or were cancelled) sent no last chunk here
            for old in [k for k, at in checked.items() if now - at > 60.0]:
                del checked[old]
        checked[key] = now
        return bool(request.is_cancelled())

    def _one(self, request) -> pb_utils.InferenceResponse | None:
        output_ids = _array(request, "output_ids")
        if output_ids is None:  # a heartbeat: nothing to say
            return None
        strip = _array(request, "strip_chars")
        text = decode_chunk(self.tokenizer, output_ids.reshape(-1).tolist(),
                            _array(request, "context_ids").reshape(-1).tolist(),
                            int(strip.reshape(-1)[0]) if strip is not None else 0)
        version = _array(request, "lora_version")
        arrays = {"text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
                  "lora_version_out": version.reshape(1, 1).astype(np.object_),
                  **{f"{name}_out": _passed_on(request, name, default) for name, default in PASSED_ON.items()}}
        # tensors only for the requested ones: the stub would drop the others without the GIL (response_tensors.py)
        requested = frozenset(request.requested_output_names())
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, array) for name, array in arrays.items() if is_requested(name, requested)])

    @staticmethod
    def _cancel(key: bytes) -> None:
        """Tell the generator to stop the request with this key (a BLS control request)."""
        command = json.dumps({"op": "cancel", "key": key.decode("ascii")}).encode("utf-8")
        control = pb_utils.Tensor("control", np.array([[command]], dtype=np.object_))
        request = pb_utils.InferenceRequest(model_name=GENERATOR, inputs=[control], requested_output_names=[])
        for response in request.exec(decoupled=True):
            if response.has_error():
                pb_utils.Logger.log_warn(f"postprocessing: cancel not passed on: {response.error().message()}")

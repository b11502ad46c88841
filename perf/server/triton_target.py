"""The running Triton server as a replay target, over gRPC streaming (tritonclient).

tritonclient allows one active stream per client object, so requests borrow a client
(with its stream already open) from a pool that grows to the peak number in flight.
``generator`` is driven with token ids (a chunk's tokens are its ids); ``llm`` with text (S-LoRA's
"Hello " * n prompt), asking for what the OpenAI front asks for: a chunk's tokens are the
``num_output_tokens`` it accounts for (a chunk holds the tokens of a stream interval), its characters are kept.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import tritonclient.grpc as grpcclient

from perf.capacity.wire import LLM_OUTPUTS
from perf.workload.records import RequestRecord
from perf.workload.replay import Clock, Tracker
from perf.workload.trace import TraceRequest


def _input(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def build_inputs(request: TraceRequest, model: str) -> tuple[list[grpcclient.InferInput], list[str]]:
    """Inputs with the batch dimension ([1, n], [1, 1]) and the outputs to ask for (the first holds the tokens or
    the text)."""
    if model == "generator":
        if request.prompt_ids is None:
            raise ValueError("the generator model needs token ids (workload vocab_range or with_token_ids)")
        inputs = [_input("input_ids", np.array([request.prompt_ids], dtype=np.int32), "INT32")]
        wanted = ["output_ids"]
    else:
        inputs = [_input("text_input", np.array([[request.prompt_text().encode()]], dtype=np.object_), "BYTES")]
        wanted = list(LLM_OUTPUTS)
    inputs += [
        _input("max_tokens", np.array([[request.output_len]], dtype=np.int32), "INT32"),
        _input("stream", np.array([[True]], dtype=np.bool_), "BOOL"),
    ]
    if request.adapter:
        inputs.append(_input("lora_name", np.array([[request.adapter.encode()]], dtype=np.object_), "BYTES"))
    return inputs, wanted


class _StreamSlot:
    """One client with an open stream; serves one request at a time."""

    def __init__(self, url: str, on_free) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.record: RequestRecord | None = None
        self.clock: Clock | None = None
        self.tracker: Tracker | None = None
        self.output = "output_ids"
        self._on_free = on_free
        self.client.start_stream(callback=self._callback)

    def _callback(self, result, error) -> None:
        rec, clock, tracker = self.record, self.clock, self.tracker
        if rec is None:
            return
        t = clock.now()
        if error is not None:
            self._release()
            tracker.finish(rec, t, str(error))
            return
        out = result.as_numpy(self.output)
        if out is not None and out.size:
            if self.output == "output_ids":
                rec.add_chunk(t, int(out.size))
            else:
                tokens = result.as_numpy("num_output_tokens")
                text = out.reshape(-1)[0].decode("utf-8", "replace")
                rec.add_chunk(t, 0 if tokens is None else int(tokens.reshape(-1)[0]), len(text))
        params = result.get_response().parameters
        if "triton_final_response" in params and params["triton_final_response"].bool_param:
            self._release()
            tracker.finish(rec, t)

    def _release(self) -> None:
        self.record = None
        self._on_free(self)

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()


class TritonTarget:
    """Streams each request to ``model`` ("generator" or "llm") on the server at ``url`` (host:port)."""

    def __init__(self, url: str, model: str = "generator", name: str | None = None) -> None:
        if model not in ("generator", "llm"):
            raise ValueError(f"model must be 'generator' or 'llm', got {model!r}")
        self.url = url
        self.model = model
        self.name = name or f"triton-{model}"
        self._free: queue.SimpleQueue[_StreamSlot] = queue.SimpleQueue()
        self._all: list[_StreamSlot] = []
        self._lock = threading.Lock()

    def _slot(self) -> _StreamSlot:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            slot = _StreamSlot(self.url, self._free.put)
            with self._lock:
                self._all.append(slot)
            return slot

    def send(self, request: TraceRequest, record: RequestRecord, clock: Clock, tracker: Tracker) -> None:
        inputs, outputs = build_inputs(request, self.model)
        slot = self._slot()
        slot.record, slot.clock, slot.tracker, slot.output = record, clock, tracker, outputs[0]
        try:
            slot.client.async_stream_infer(
                self.model,
                inputs,
                request_id=str(request.index),
                outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                enable_empty_final_response=True,
            )
        except Exception:
            slot.record = None
            self._free.put(slot)
            raise

    @property
    def streams_opened(self) -> int:
        return len(self._all)

    def close(self) -> None:
        with self._lock:
            slots, self._all = self._all, []
        for s in slots:
            s.close()

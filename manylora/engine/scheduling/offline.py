"""Blocking use of the engine from plain Python: submit requests, wait for every result."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from manylora.engine.errors import RequestError
from manylora.engine.requests.types import GenerationOutput, GenerationRequest
from manylora.engine.scheduling.engine import Engine


@dataclass
class Completion:
    """Everything one request produced, with timings for benchmarks."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    chunks: list[GenerationOutput] = field(default_factory=list)
    finish_reason: str | None = None
    error: RequestError | None = None
    submitted_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # perf_counter at each chunk with tokens
    finished_at: float = 0.0

    def text(self, tokenizer) -> str:
        from manylora.engine.requests.detokenize import decode_chunk

        return "".join(decode_chunk(tokenizer, c.token_ids, c.context_ids, c.strip_chars) for c in self.chunks)


def generate(engine: Engine, requests: list[GenerationRequest], timeout: float = 300.0) -> list[Completion]:
    """Submit all requests at once and wait; a request refused at submit carries its error. An engine
    made with start=False is started after the last submit, so its first step sees them all."""
    results = {r.request_id: Completion(r.request_id) for r in requests}
    if len(results) != len(requests):
        raise ValueError("request ids must be unique within one generate() call")
    remaining = len(requests)
    lock = threading.Lock()
    done = threading.Event()

    def emitter(rid: str):
        def emit(out: GenerationOutput) -> None:
            nonlocal remaining
            c = results[rid]
            now = time.perf_counter()
            c.chunks.append(out)
            c.token_ids += out.token_ids
            if out.token_ids:
                c.token_times.append(now)
            if out.finished:
                c.finish_reason, c.error, c.finished_at = out.finish_reason, out.error, now
                with lock:
                    remaining -= 1
                    if remaining == 0:
                        done.set()
        return emit

    for r in requests:
        results[r.request_id].submitted_at = time.perf_counter()
        try:
            engine.submit(r, emitter(r.request_id))
        except RequestError as e:
            c = results[r.request_id]
            c.error, c.finish_reason = e, "error"
            with lock:
                remaining -= 1
    engine.start()  # an engine made with start=False sees every request queued before its first step
    if remaining and not done.wait(timeout):
        raise TimeoutError(f"{remaining} of {len(requests)} requests unfinished after {timeout}s")
    return [results[r.request_id] for r in requests]

"""The engine in-process as a replay target: exact lengths (ignore_eos, max_tokens = output_len)."""

from __future__ import annotations

import threading
import time

from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams
from manylora.engine.scheduling.engine import Engine
from perf.workload.records import RequestRecord
from perf.workload.replay import Clock, Tracker
from perf.workload.trace import TraceRequest


class EngineTarget:
    """Submits each request to a running :class:`Engine`; token times come from its emit callback."""

    def __init__(self, engine: Engine, name: str = "engine", run_id: str = "r") -> None:
        self.engine = engine
        self.name = name
        self.run_id = run_id
        self._closed = threading.Event()

    def send(self, request: TraceRequest, record: RequestRecord, clock: Clock, tracker: Tracker) -> None:
        if request.prompt_ids is None:
            raise ValueError("the engine target needs token ids (workload vocab_range or with_token_ids)")

        def emit(out: GenerationOutput) -> None:
            t = clock.now()
            record.add_chunk(t, len(out.token_ids))
            if out.finished:
                tracker.finish(record, t, None if out.error is None else str(out.error))

        self.engine.submit(
            GenerationRequest(
                request_id=f"{self.run_id}-{request.index}",
                prompt_ids=list(request.prompt_ids),
                adapter=request.adapter,
                sampling=SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True),
                is_cancelled=self._closed.is_set,
            ),
            emit,
        )

    def close(self, timeout: float = 60.0) -> None:
        """Cancel what is still running (a capped replay) and wait until the engine is idle."""
        self._closed.set()
        wait_idle(self.engine, timeout)


def wait_idle(engine, timeout: float) -> bool:
    """Wait until the engine runs and queues nothing (at most ``timeout`` s); whether it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False

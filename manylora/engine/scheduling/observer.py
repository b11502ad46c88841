"""What the engine reports as it works, for metrics: one callback per event, cheap and non-blocking.

Events are per request (arrival, first token, end, failure) and per adapter load, never per token:
every histogram observation is a round trip to the Triton server process, so the time between a
request's tokens is reported once, as its mean, when it ends.

The Triton model file turns these into Prometheus metrics (pb_utils.MetricFamily); tests
and benchmarks can record them in memory. Callbacks run on the engine thread (and adapter
loads on the loader threads): they must not block.
"""

from __future__ import annotations

from typing import Protocol


class EngineObserver(Protocol):
    def request_arrived(self, adapter: str | None) -> None: ...

    def request_failed(self, adapter: str | None, code: str) -> None: ...

    def first_token(self, adapter: str | None, queue_s: float, ttft_s: float) -> None: ...

    def request_finished(self, adapter: str | None, prompt_tokens: int, output_tokens: int, reason: str,
                         time_per_output_token_s: float | None = None) -> None: ...

    def adapter_loaded(self, adapter: str, seconds: float) -> None: ...


class NullObserver:
    """Observes nothing."""

    def request_arrived(self, adapter: str | None) -> None:
        pass

    def request_failed(self, adapter: str | None, code: str) -> None:
        pass

    def first_token(self, adapter: str | None, queue_s: float, ttft_s: float) -> None:
        pass

    def request_finished(self, adapter: str | None, prompt_tokens: int, output_tokens: int, reason: str,
                         time_per_output_token_s: float | None = None) -> None:
        pass

    def adapter_loaded(self, adapter: str, seconds: float) -> None:
        pass


class AdapterLabels:
    """Bounds metric label cardinality: the first ``limit`` adapters seen get their own label,
    the rest share "other" (10,000 adapters stay ``limit`` + 2 label values); the base model
    is "base"."""

    def __init__(self, limit: int = 100) -> None:
        self.limit = limit
        self._labels: dict[str, str] = {}

    def __call__(self, adapter: str | None) -> str:
        if not adapter:
            return "base"
        label = self._labels.get(adapter)
        if label is None:
            label = adapter if len(self._labels) < self.limit else "other"
            if label != "other":
                self._labels[adapter] = label
        return label

"""Prometheus metrics of the generator, through the Python backend's custom metrics API.

MetricsObserver is the engine's EngineObserver: its callbacks run on the engine thread (and
adapter loads on the loader threads). Every pb_utils metric call is a message to the server
process and a wait for its answer, so the callbacks make none: they append to a buffer (a list
append under a lock), and the stats poller's thread (StatsPoller) flushes it every interval,
counters summed per series, histogram values observed one by one. The engine thread never waits
on the server process, and the metric calls come from one thread. Gauges and the adapter-tier
counters come from Engine.stats(), polled by the same thread; counters advance by the deltas
between polls. Nothing here raises into the engine.

The Triton API is passed in (``pb_utils``), so tests can hand in a fake.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from manylora.engine.scheduling.observer import AdapterLabels

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
LOAD_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

# name -> (kind, description, buckets or None); every family the generator exports
FAMILIES: dict[str, tuple[str, str, list[float] | None]] = {
    "manylora_requests_total": ("COUNTER", "Requests admitted, by adapter", None),
    "manylora_request_errors_total": ("COUNTER", "Requests that ended in an error, by adapter and code", None),
    "manylora_prompt_tokens_total": ("COUNTER", "Prompt tokens of finished requests, by adapter", None),
    "manylora_output_tokens_total": ("COUNTER", "Output tokens of finished requests, by adapter", None),
    "manylora_time_to_first_token_seconds": ("HISTOGRAM", "Submit to first token, by adapter", LATENCY_BUCKETS),
    "manylora_time_per_output_token_seconds": ("HISTOGRAM", "Mean time between a request's output tokens, by adapter",
                                               ITL_BUCKETS),
    "manylora_queue_time_seconds": ("HISTOGRAM", "Submit to first scheduled step, by adapter", LATENCY_BUCKETS),
    "manylora_adapter_load_seconds": ("HISTOGRAM", "Adapter load from disk into the host cache", LOAD_BUCKETS),
    "manylora_adapter_loads_total": ("COUNTER", "Adapter uploads into the GPU pool", None),
    "manylora_adapter_evictions_total": ("COUNTER", "Adapters evicted from the GPU pool", None),
    "manylora_host_cache_hits_total": ("COUNTER", "Adapter lookups served by the host-memory cache", None),
    "manylora_host_cache_misses_total": ("COUNTER", "Adapter lookups that had to read the disk", None),
    "manylora_host_cache_loads_total": ("COUNTER", "Adapters read from disk into the host cache", None),
    "manylora_pool_pages": ("GAUGE", "Pages of the unified pool by use (kv, adapters, free)", None),
    "manylora_requests_running": ("GAUGE", "Requests in the running batch", None),
    "manylora_requests_waiting": ("GAUGE", "Requests waiting for admission", None),
    "manylora_adapters_resident": ("GAUGE", "Adapters resident in the GPU pool", None),
    "manylora_adapters_refused": ("GAUGE", "Catalogue adapters refused at startup (list_adapters says why)", None),
    "manylora_steps_total": ("COUNTER", "Engine steps by how they ran (decode_graph, mixed_graph, eager)", None),
    "manylora_mixed_step_buckets": ("GAUGE", "Mixed-step token buckets captured in CUDA graphs (0: those steps run "
                                             "eagerly)", None),
    "manylora_engine_loop_seconds_total": ("COUNTER", "The engine loop's wall time by where it went (step: running "
                                                      "steps; sending: outputs to the generator; idle: no work)", None),
}
PER_ADAPTER = {name for name in FAMILIES if name.startswith(("manylora_request", "manylora_prompt", "manylora_output",
                                                             "manylora_time_", "manylora_queue"))}
PER_ADAPTER -= {"manylora_requests_running", "manylora_requests_waiting"}
# stats() counter -> metric family it advances
STATS_COUNTERS = {
    "adapter_uploads": "manylora_adapter_loads_total",
    "adapter_evictions": "manylora_adapter_evictions_total",
    "host_hits": "manylora_host_cache_hits_total",
    "host_misses": "manylora_host_cache_misses_total",
    "host_loads": "manylora_host_cache_loads_total",
}
# stats() counter -> the `kind` label of manylora_steps_total it advances
STEP_KINDS = {"steps_decode_graph": "decode_graph", "steps_mixed_graph": "mixed_graph", "steps_eager": "eager"}
# stats() seconds -> the `part` label of manylora_engine_loop_seconds_total they advance (loop_times.py)
LOOP_PARTS = {"loop_step_seconds": "step", "loop_hook_seconds": "sending", "loop_idle_seconds": "idle"}


class MetricsObserver:
    """EngineObserver that records into pb_utils.MetricFamily metrics.

    Raises at construction if the server runs with metrics off (MetricFamily creation
    fails); the caller then runs without metrics.
    """

    def __init__(self, pb_utils, adapter_labels: int = 100, on_error: Callable[[str], None] | None = None) -> None:
        self._pb = pb_utils
        self._on_error = on_error or (lambda message: None)
        self.labels = AdapterLabels(adapter_labels)
        self._families = {}
        for name, (kind, description, _) in FAMILIES.items():
            kind_value = getattr(pb_utils.MetricFamily, kind)
            self._families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind_value)
        self._metrics: dict[tuple, object] = {}
        # pb_utils calls (creation, flush, stats) go one at a time
        self._lock = threading.RLock()
        # (family, labels, "increment" | "observe", value) recorded by the callbacks, applied by flush();
        # the lock also covers the callbacks' label bookkeeping (engine thread, loaders, execute())
        self._pending: list[tuple[str, dict, str, float]] = []
        self._pending_lock = threading.RLock()
        self._errors_reported = 0
        self._labelled: set[str] = set()  # adapters with their own label (at most adapter_labels)
        for name in FAMILIES:  # series without labels exist from the start
            if name not in ("manylora_pool_pages", "manylora_steps_total") and name not in PER_ADAPTER:
                self.metric(name)
        for kind in STEP_KINDS.values():
            self.metric("manylora_steps_total", kind=kind)
        for use in ("kv", "adapters", "free"):
            self.metric("manylora_pool_pages", use=use)

    def _failed_label(self, adapter: str | None) -> str:
        """An adapter that failed before it was ever admitted (an unknown name, a flood of random
        names) gets no label of its own: "other", so refusals cannot exhaust the label budget."""
        if not adapter:
            return "base"
        return adapter if adapter in self._labelled else "other"

    @staticmethod
    def _key(family: str, labels: dict) -> tuple:
        return (family, *sorted(labels.items()))

    def metric(self, family: str, **labels: str):
        key = self._key(family, labels)
        metric = self._metrics.get(key)
        if metric is None:
            with self._lock:
                metric = self._metrics.get(key)
                if metric is None:
                    buckets = FAMILIES[family][2]
                    fam = self._families[family]
                    metric = fam.Metric(labels=labels, buckets=buckets) if buckets else fam.Metric(labels=labels)
                    self._metrics[key] = metric
        return metric

    def _report(self, e: Exception) -> None:
        if self._errors_reported < 5:
            self._errors_reported += 1
            self._on_error(f"generator metrics: {type(e).__name__}: {e}")

    def _safe(self, fn: Callable[[], None]) -> None:
        """Run a callback's bookkeeping (pure Python, no pb_utils call); never raise."""
        try:
            with self._pending_lock:
                fn()
        except Exception as e:  # noqa: BLE001 - metrics must never break the engine thread
            self._report(e)

    def _record(self, family: str, op: str, value: float, **labels: str) -> None:
        with self._pending_lock:
            self._pending.append((family, labels, op, value))

    def flush(self) -> None:
        """Apply what the callbacks recorded since the last flush: one increment per counter series,
        one observe per histogram value. Called by the poller's thread."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        increments: dict[tuple, float] = {}
        for family, labels, op, value in pending:
            if op == "increment":
                key = self._key(family, labels)
                increments[key] = increments.get(key, 0.0) + value
        with self._lock:
            for family, labels, op, value in pending:
                try:
                    if op == "observe":
                        self.metric(family, **labels).observe(value)
                except Exception as e:  # noqa: BLE001 - one bad value must not stop the rest
                    self._report(e)
            for (family, *labels), total in increments.items():
                try:
                    self.metric(family, **dict(labels)).increment(total)
                except Exception as e:  # noqa: BLE001
                    self._report(e)

    # -- EngineObserver --------------------------------------------------------------------
    def request_arrived(self, adapter: str | None) -> None:
        def record() -> None:
            label = self.labels(adapter)
            if adapter and label == adapter:
                self._labelled.add(adapter)
            self._record("manylora_requests_total", "increment", 1, adapter=label)

        self._safe(record)

    def request_failed(self, adapter: str | None, code: str) -> None:
        def record() -> None:
            labels = {"adapter": self._failed_label(adapter), "code": str(code)}
            self._record("manylora_request_errors_total", "increment", 1, **labels)

        self._safe(record)

    def first_token(self, adapter: str | None, queue_s: float, ttft_s: float) -> None:
        def record() -> None:
            label = self.labels(adapter)
            queue, ttft = max(0.0, float(queue_s)), max(0.0, float(ttft_s))
            self._record("manylora_queue_time_seconds", "observe", queue, adapter=label)
            self._record("manylora_time_to_first_token_seconds", "observe", ttft, adapter=label)

        self._safe(record)

    def request_finished(self, adapter: str | None, prompt_tokens: int, output_tokens: int, reason: str,
                         time_per_output_token_s: float | None = None) -> None:
        def record() -> None:
            label = self.labels(adapter)
            prompt, output = int(prompt_tokens), int(output_tokens)
            self._record("manylora_prompt_tokens_total", "increment", prompt, adapter=label)
            self._record("manylora_output_tokens_total", "increment", output, adapter=label)
            if time_per_output_token_s is not None:
                self._record("manylora_time_per_output_token_seconds", "observe",
                             max(0.0, float(time_per_output_token_s)), adapter=label)

        self._safe(record)

    def adapter_loaded(self, adapter: str, seconds: float) -> None:
        self._safe(lambda: self._record("manylora_adapter_load_seconds", "observe", max(0.0, float(seconds))))

    # -- from Engine.stats() ----------------------------------------------------------------
    def record_stats(self, stats: dict, previous: dict) -> None:
        """Set the gauges and advance the tier counters by what changed since ``previous``."""
        with self._lock:
            self._record_stats(stats, previous)

    def _record_stats(self, stats: dict, previous: dict) -> None:
        for use in ("kv", "adapters", "free"):
            if f"pool_pages_{use}" in stats:
                self.metric("manylora_pool_pages", use=use).set(float(stats[f"pool_pages_{use}"]))
        if "running" in stats:
            self.metric("manylora_requests_running").set(float(stats["running"]))
        if "waiting" in stats:
            self.metric("manylora_requests_waiting").set(float(stats["waiting"]))
        resident = stats.get("adapters_resident")
        if resident is not None:
            count = len(resident) if isinstance(resident, (list, tuple, set, dict)) else resident
            self.metric("manylora_adapters_resident").set(float(count))
        if "adapters_refused" in stats:
            self.metric("manylora_adapters_refused").set(float(stats["adapters_refused"]))
        if "mixed_step_buckets" in stats:
            self.metric("manylora_mixed_step_buckets").set(float(len(stats["mixed_step_buckets"])))
        counters = [(key, self.metric(family)) for key, family in STATS_COUNTERS.items() if key in stats]
        counters += [(key, self.metric("manylora_steps_total", kind=kind)) for key, kind in STEP_KINDS.items()
                     if key in stats]
        counters += [(key, self.metric("manylora_engine_loop_seconds_total", part=part))
                     for key, part in LOOP_PARTS.items() if key in stats]
        for key, metric in counters:  # counts and seconds alike (a count is exact as a float)
            delta = float(stats[key]) - float(previous.get(key, 0))
            if delta > 0 or key not in previous:  # the first poll creates the series at 0
                metric.increment(max(0.0, delta))


class StatsPoller:
    """Every ``interval`` seconds (daemon thread): flushes the observer's buffered events and polls
    ``stats()`` into ``observer.record_stats``."""

    def __init__(self, stats: Callable[[], dict], observer: MetricsObserver, interval: float = 0.5,
                 on_error: Callable[[str], None] | None = None) -> None:
        self._stats, self._observer, self._interval = stats, observer, interval
        self._on_error = on_error or (lambda message: None)
        self._stop = threading.Event()
        self._previous: dict = {}
        self._thread = threading.Thread(target=self._run, name="manylora-metrics", daemon=True)

    def start(self) -> StatsPoller:
        self._thread.start()
        return self

    def poll(self) -> None:
        self._observer.flush()
        stats = self._stats()
        self._observer.record_stats(stats, self._previous)
        self._previous = {k: stats[k] for k in (*STATS_COUNTERS, *STEP_KINDS, *LOOP_PARTS) if k in stats}

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a failed poll is retried at the next tick
                failures += 1
                if failures <= 5:
                    self._on_error(f"generator metrics poll: {type(e).__name__}: {e}")

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop polling; whether the thread has ended (a poll can outlast ``timeout`` while the server stops)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()


def close(observer: MetricsObserver | None) -> None:
    """Drop the Metric objects before their families (the backend insists on that order)."""
    if observer is not None:
        observer._metrics.clear()
        observer._families.clear()

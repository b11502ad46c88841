"""The front's /metrics: the engine's state in the names LLM routers read (Prometheus text format).

The Gateway API inference extension's endpoint picker scrapes each model server's /metrics (by
default on the port it sends requests to: this front's) for vLLM's names: the queue
(``vllm:num_requests_waiting``), the batch (``vllm:num_requests_running``), the cache's fullness
(``vllm:kv_cache_usage_perc``, a fraction; here the share of the unified pool's pages in use, KV
and adapters together, since they share it), its block size and count (``vllm:cache_config_info``),
and for adapter affinity ``vllm:lora_requests_info``: a gauge whose labels list the adapters of
running and of waiting requests (comma-separated) and ``max_lora`` (adapters one batch can hold), and
whose value is the time of the reading, so that the picker takes the newest series. vLLM keeps every
label set it ever exported as a series of its own; here only the current one is exported (the
picker reads only the newest anyway). Beside them, ``manylora_adapter_requests{adapter, state}``
counts each adapter's running and waiting requests.

Every value comes from the engine's ``stats`` (a control request to the generator), asked at most
every ``stats_interval_s``: concurrent scrapes share one request, later ones within the interval its
answer. The front adds its own counters (FrontCounters, kept by CountingMiddleware):
``manylora_openai_requests_total{route, status}`` and ``manylora_openai_requests_in_flight``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(stats: dict, at: float) -> str:
    """Prometheus text for one ``stats`` answer read at time ``at`` (seconds since the epoch)."""
    running = stats.get("running_adapters") or {}
    waiting = stats.get("waiting_adapters") or {}
    total = stats.get("pool_pages_total") or 0
    used = total - (stats.get("pool_pages_free") or 0) if total else 0
    lines = [
        "# HELP vllm:num_requests_running Requests in the running batch.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running {int(stats.get('running', 0))}",
        "# HELP vllm:num_requests_waiting Requests waiting for admission.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting {int(stats.get('waiting', 0))}",
        "# HELP vllm:kv_cache_usage_perc Share of the unified pool's pages in use (KV cache and adapters), 0 to 1.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc {used / total if total else 0.0:.6f}",
        "# HELP vllm:cache_config_info The pool's page size (tokens) and page count.",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{int(stats.get("page_size", 0))}",num_gpu_blocks="{int(total)}"}} 1',
        "# HELP vllm:lora_requests_info Adapters of running and waiting requests and max_lora; the value is the "
        "time of the reading.",
        "# TYPE vllm:lora_requests_info gauge",
        f'vllm:lora_requests_info{{max_lora="{int(stats.get("max_loras", 0))}",'
        f'running_lora_adapters="{_label(",".join(sorted(running)))}",'
        f'waiting_lora_adapters="{_label(",".join(sorted(waiting)))}"}} {at:.3f}',
        "# HELP manylora_adapter_requests Requests per adapter, running or waiting.",
        "# TYPE manylora_adapter_requests gauge",
    ]
    for state, counts in (("running", running), ("waiting", waiting)):
        for name in sorted(counts):
            lines.append(f'manylora_adapter_requests{{adapter="{_label(name)}",state="{state}"}} {int(counts[name])}')
    return "\n".join(lines) + "\n"


class RouterMetrics:
    """render() of the engine's stats, asked at most every ``interval_s`` (module docstring)."""

    def __init__(self, fetch_stats: Callable[[], Awaitable[dict]], interval_s: float) -> None:
        self._fetch = fetch_stats
        self.interval_s = interval_s
        self._last: tuple[float, float, dict] | None = None  # (monotonic, epoch, stats)
        self._pending: asyncio.Future | None = None

    async def text(self) -> str:
        _, at, stats = await self._reading()
        return render(stats, at)

    async def _reading(self) -> tuple[float, float, dict]:
        last = self._last
        if last is not None and time.monotonic() - last[0] < self.interval_s:
            return last
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._read())
        pending = self._pending
        try:
            return await asyncio.shield(pending)
        finally:
            if pending.done() and self._pending is pending:
                self._pending = None

    async def _read(self) -> tuple[float, float, dict]:
        stats = await self._fetch()
        self._last = (time.monotonic(), time.time(), stats)
        return self._last


class FrontCounters:
    """The front's own counters: ``manylora_openai_requests_total{route, status}`` (routes of the API only; any other
    path counts as route="other", so that no client can add series) and the requests in flight."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter",
              "/v1/unload_lora_adapter", "/health", "/metrics")

    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0

    def route(self, path: str) -> str:
        if path.startswith("/v1/models/"):
            return "/v1/models"
        return path if path in self.ROUTES else "other"

    def observe(self, path: str, status: int) -> None:
        key = (self.route(path), int(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self) -> str:
        lines = ["# HELP manylora_openai_requests_total Requests the OpenAI-compatible front answered, by route and "
                 "HTTP status (499: the client left first).",
                 "# TYPE manylora_openai_requests_total counter"]
        for (route, status), count in sorted(self.requests.items()):
            lines.append(f'manylora_openai_requests_total{{route="{route}",status="{status}"}} {count}')
        lines += ["# HELP manylora_openai_requests_in_flight Requests the front is answering now.",
                  "# TYPE manylora_openai_requests_in_flight gauge",
                  f"manylora_openai_requests_in_flight {self.in_flight}"]
        return "\n".join(lines) + "\n"


class CountingMiddleware:
    """ASGI middleware that counts every HTTP request in FrontCounters once its response has started (a plain ASGI
    wrapper: Starlette's BaseHTTPMiddleware would come between a stream and its client's disconnect)."""

    def __init__(self, app, counters: FrontCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.counters.in_flight += 1
        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.counters.in_flight -= 1
            self.counters.observe(scope.get("path", ""), status)

"""The front's /metrics text (metrics.py): the names and labels LLM routers read, the caching of the engine's stats,
the front's own counters."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

pytest.importorskip("fastapi")
from manylora.openai.metrics import FrontCounters, RouterMetrics, render  # noqa: E402

STATS = {"running": 3, "waiting": 5, "running_adapters": {"b-2": 1, "a,1": 1}, "waiting_adapters": {"c\"q": 4},
         "max_loras": 8, "page_size": 16, "pool_pages_total": 200, "pool_pages_free": 150}
SAMPLE = re.compile(r'^(?P<name>[a-z_:]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        out.append((match["name"], labels, float(match["value"])))
    return out


def test_render_in_the_form_the_inference_extension_reads():
    at = time.time()
    samples = _samples(render(STATS, at))
    by_name = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((labels, value))
    assert by_name["vllm:num_requests_running"] == [({}, 3.0)]
    assert by_name["vllm:num_requests_waiting"] == [({}, 5.0)]
    assert by_name["vllm:kv_cache_usage_perc"] == [({}, 0.25)]
    (labels, value), = by_name["vllm:lora_requests_info"]
    assert labels == {"max_lora": "8", "running_lora_adapters": "a,1,b-2", "waiting_lora_adapters": 'c\\"q'}
    assert value == pytest.approx(at, abs=0.01)  # the value is the time of the reading
    assert sorted((l["adapter"], l["state"], v) for l, v in by_name["manylora_adapter_requests"]) == \
        [("a,1", "running", 1.0), ("b-2", "running", 1.0), ('c\\"q', "waiting", 4.0)]
    assert by_name["vllm:cache_config_info"] == [({"block_size": "16", "num_gpu_blocks": "200"}, 1.0)]
    text = render(STATS, at)
    for name in ("vllm:num_requests_running", "vllm:lora_requests_info", "manylora_adapter_requests"):
        assert f"# TYPE {name} gauge" in text


def test_render_of_an_idle_engine():
    samples = _samples(render({"running": 0, "waiting": 0, "max_loras": 4}, 1.0))
    info = [labels for name, labels, _ in samples if name == "vllm:lora_requests_info"]
    assert info == [{"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}]
    assert not [s for s in samples if s[0] == "manylora_adapter_requests"]


def test_concurrent_scrapes_share_one_stats_request_within_the_interval():
    calls = []

    async def fetch() -> dict:
        calls.append(time.monotonic())
        await asyncio.sleep(0.05)
        return {**STATS, "running": len(calls)}

    async def scenario() -> list[str]:
        metrics = RouterMetrics(fetch, interval_s=0.3)
        texts = await asyncio.gather(*(metrics.text() for _ in range(10)))
        texts.append(await metrics.text())  # within the interval: the same reading
        await asyncio.sleep(0.35)
        texts.append(await metrics.text())  # after it: a new one
        return texts

    texts = asyncio.run(scenario())
    assert len(calls) == 2
    assert all("vllm:num_requests_running 1\n" in t for t in texts[:11])
    assert "vllm:num_requests_running 2\n" in texts[11]


def test_a_failed_stats_request_is_not_cached():
    attempts = []

    async def fetch() -> dict:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("server away")
        return STATS

    async def scenario() -> str:
        metrics = RouterMetrics(fetch, interval_s=10)
        with pytest.raises(RuntimeError):
            await metrics.text()
        return await metrics.text()

    assert "vllm:num_requests_waiting 5" in asyncio.run(scenario())


def test_front_counters_bound_their_routes():
    counters = FrontCounters()
    for path, status in (("/v1/completions", 200), ("/v1/completions", 200), ("/v1/models/base:a", 404),
                         ("/random/1", 404), ("/random/2", 404), ("/v1/chat/completions", 499)):
        counters.observe(path, status)
    samples = {(labels["route"], labels["status"]): value for name, labels, value in _samples(counters.render())
               if name == "manylora_openai_requests_total"}
    assert samples == {("/v1/completions", "200"): 2, ("/v1/models", "404"): 1, ("other", "404"): 2,
                       ("/v1/chat/completions", "499"): 1}

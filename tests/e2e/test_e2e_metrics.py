"""Metrics (issue "see inside"): the generator's MetricsObserver, the Grafana dashboard, and the
real server's /metrics after known traffic."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
PROMPTS = ("In the morning the baker", "The river runs by")


def _load_metrics_module():
    path = REPO / "model_repository" / "generator" / "1" / "generator_metrics.py"
    spec = importlib.util.spec_from_file_location("generator_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gm = _load_metrics_module()


# -- the observer against a fake pb_utils --------------------------------------------------

class _FakeMetric:
    def __init__(self, labels, buckets):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

    def increment(self, v):
        assert v >= 0
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        assert self.buckets is not None
        self.observed.append(v)


class _FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list = []

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        _FakeFamily.created.append(self)

    def Metric(self, labels=None, buckets=None):  # noqa: N802 - the pb_utils spelling
        assert (buckets is not None) == (self.kind == "histogram"), self.name
        metric = _FakeMetric(labels or {}, buckets)
        self.metrics.append(metric)
        return metric


class _FakePb:
    MetricFamily = _FakeFamily


class _NoMetricsPb:
    class MetricFamily:
        COUNTER = GAUGE = HISTOGRAM = 0

        def __init__(self, **_):
            raise RuntimeError("Failed to create metric family: metrics not supported")


def _value(observer, family, **labels):
    observer.flush()
    return observer.metric(family, **labels).value


def test_observer_records_and_bounds_adapter_labels():
    obs = gm.MetricsObserver(_FakePb, adapter_labels=2)
    for name in ["a", "b", "c", "d", None, "a"]:
        obs.request_arrived(name)
    assert _value(obs, "manylora_requests_total", adapter="a") == 2
    assert _value(obs, "manylora_requests_total", adapter="other") == 2  # c, d
    assert _value(obs, "manylora_requests_total", adapter="base") == 1
    obs.request_failed("a", "INVALID_ARG")
    for i in range(1000):  # unknown names never admitted: no label each
        obs.request_failed(f"random-{i}", "NOT_FOUND")
    assert _value(obs, "manylora_request_errors_total", adapter="other", code="NOT_FOUND") == 1000
    obs.first_token("a", 0.01, 0.2)
    obs.request_finished("a", 7, 3, "length", 0.02)
    obs.adapter_loaded("a", 0.5)
    assert _value(obs, "manylora_prompt_tokens_total", adapter="a") == 7  # flushes
    assert obs.metric("manylora_time_to_first_token_seconds", adapter="a").observed == [0.2]
    assert obs.metric("manylora_adapter_load_seconds").observed == [0.5]
    labels = {tuple(sorted(m.labels.items())) for f in _FakeFamily.created for m in f.metrics}
    assert len({dict(lab).get("adapter") for lab in labels} - {None}) <= 2 + 2  # a, b + base, other


def test_callbacks_make_no_metric_calls_until_the_poller_flushes():
    """The engine thread's callbacks only buffer: every pb_utils call (a round trip to the server process)
    happens in flush(), on the poller's thread, with counters summed per series."""
    obs = gm.MetricsObserver(_FakePb)
    calls = []
    families = list(obs._families.values())
    created = sum(len(f.metrics) for f in families)
    for family in families:
        for metric in family.metrics:
            for op in ("increment", "observe", "set"):
                real = getattr(metric, op)
                setattr(metric, op, lambda v, real=real, op=op: (calls.append(op), real(v)))
    engine_thread = threading.Thread(target=lambda: [
        (obs.request_arrived("a"), obs.first_token("a", 0.01, 0.1),
         obs.request_finished("a", 5, 2, "length", 0.02)) for _ in range(50)])
    engine_thread.start()
    engine_thread.join()
    assert calls == [] and all(not m.value and not m.observed for f in families for m in f.metrics)
    assert sum(len(f.metrics) for f in families) == created, "no series created from the engine thread either"
    gm.StatsPoller(lambda: {}, obs).poll()
    assert _value(obs, "manylora_requests_total", adapter="a") == 50
    assert _value(obs, "manylora_output_tokens_total", adapter="a") == 100
    assert obs.metric("manylora_time_per_output_token_seconds", adapter="a").observed == [0.02] * 50
    # one increment per counter series, not one per event
    assert obs.metric("manylora_requests_total", adapter="a").value == 50
    obs.flush()  # nothing pending: no calls
    assert _value(obs, "manylora_requests_total", adapter="a") == 50


def test_observer_stats_gauges_and_counter_deltas():
    obs = gm.MetricsObserver(_FakePb)
    poller = gm.StatsPoller(lambda: stats, obs)
    stats = {"pool_pages_kv": 3, "pool_pages_adapters": 5, "pool_pages_free": 90, "running": 2, "waiting": 1,
             "adapters_resident": ["a", "b"], "adapter_uploads": 4, "adapter_evictions": 1, "host_hits": 2,
             "host_misses": 4, "host_loads": 4}
    poller.poll()
    stats = {**stats, "adapter_uploads": 6, "host_hits": 5, "adapters_resident": ["a"]}
    poller.poll()
    assert _value(obs, "manylora_pool_pages", use="free") == 90
    assert _value(obs, "manylora_adapters_resident") == 1
    assert _value(obs, "manylora_adapter_loads_total") == 6
    assert _value(obs, "manylora_host_cache_hits_total") == 5
    assert _value(obs, "manylora_adapter_evictions_total") == 1


def test_observer_counts_steps_by_kind_and_the_captured_buckets():
    """The engine's step kinds become manylora_steps_total{kind} (advanced by what changed between polls) and the
    captured mixed-step buckets a gauge whose 0 on a GPU says those steps run eagerly."""
    obs = gm.MetricsObserver(_FakePb)
    assert {_value(obs, "manylora_steps_total", kind=k) for k in ("decode_graph", "mixed_graph", "eager")} == {0}
    poller = gm.StatsPoller(lambda: stats, obs)
    stats = {"steps_decode_graph": 40, "steps_mixed_graph": 7, "steps_eager": 3, "mixed_step_buckets": [64, 128, 192]}
    poller.poll()
    stats = {**stats, "steps_decode_graph": 95, "steps_eager": 4, "mixed_step_buckets": []}
    poller.poll()
    assert _value(obs, "manylora_steps_total", kind="decode_graph") == 95
    assert _value(obs, "manylora_steps_total", kind="mixed_graph") == 7
    assert _value(obs, "manylora_steps_total", kind="eager") == 4
    assert _value(obs, "manylora_mixed_step_buckets") == 0


def test_observer_advances_the_loop_seconds_by_part():
    """The engine loop's seconds (step, sending, idle) become manylora_engine_loop_seconds_total{part}, advanced by
    what changed between polls: the counter ends at the engine's own total."""
    rng = random.Random()
    obs = gm.MetricsObserver(_FakePb)
    poller = gm.StatsPoller(lambda: stats, obs)
    stats = {key: 0.0 for key in gm.LOOP_PARTS}
    for _ in range(rng.randrange(2, 8)):
        stats = {key: seconds + rng.choice([0.0, rng.uniform(0, 3)]) for key, seconds in stats.items()}
        poller.poll()
    for key, part in gm.LOOP_PARTS.items():
        assert _value(obs, "manylora_engine_loop_seconds_total", part=part) == pytest.approx(stats[key])


def test_observer_never_raises():
    obs = gm.MetricsObserver(_FakePb)
    obs.first_token("a", "not a number", None)  # swallowed
    obs.request_finished("a", None, None, "x")


def test_metrics_off_raises_at_creation():
    with pytest.raises(RuntimeError, match="metrics not supported"):
        gm.MetricsObserver(_NoMetricsPb)


# -- the dashboard -------------------------------------------------------------------------

def _dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b(manylora_[a-z_]+)", expr))
    return names


def _exported(name: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", name)


def test_dashboard_is_json_and_uses_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"] and any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    used = _dashboard_metrics()
    unknown = {n for n in used if _exported(n) not in gm.FAMILIES}
    assert not unknown, unknown
    histograms = {n for n, (kind, _, _) in gm.FAMILIES.items() if kind == "HISTOGRAM"}
    assert {_exported(n) for n in used} >= histograms | {"manylora_requests_total", "manylora_pool_pages"}
    assert all(f"{h}_bucket" in used for h in histograms if h != "manylora_adapter_load_seconds")


# -- the real server -----------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape(server) -> dict[tuple[str, frozenset], float]:
    samples = {}
    for line in server.metrics().splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def _get(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.e2e
def test_metrics_after_known_traffic(server, client, tokenizer):
    adapters = [None, *sorted(server.catalogue)[:2]]
    time.sleep(1.2)  # a stats poll after any earlier traffic
    before = scrape(server)
    sent: dict[str, dict[str, int]] = {}
    for adapter in adapters:
        label = adapter or "base"
        sent[label] = {"requests": 0, "prompt": 0, "output": 0, "several": 0}
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt, add_special_tokens=True).ids
            out = client.generate_ids(ids, adapter=adapter, max_tokens=6)
            sent[label]["requests"] += 1
            sent[label]["prompt"] += len(ids)
            sent[label]["output"] += len(out)
            sent[label]["several"] += len(out) >= 2  # the requests with a time per output token
    with pytest.raises(Exception, match="nope"):
        client.generate("Hi", adapter="nope", max_tokens=2)
    time.sleep(1.5)
    after = scrape(server)

    def delta(name, **labels):
        return _get(after, name, **labels) - _get(before, name, **labels)

    for label, counts in sent.items():
        assert delta("manylora_requests_total", adapter=label) == counts["requests"], label
        assert delta("manylora_prompt_tokens_total", adapter=label) == counts["prompt"], label
        assert delta("manylora_output_tokens_total", adapter=label) == counts["output"], label
        assert delta("manylora_time_to_first_token_seconds_count", adapter=label) == counts["requests"], label
        assert delta("manylora_queue_time_seconds_count", adapter=label) == counts["requests"], label
        tpot = delta("manylora_time_per_output_token_seconds_count", adapter=label)
        assert tpot == counts["several"], (label, tpot)
        ttft = delta("manylora_time_to_first_token_seconds_sum", adapter=label) / counts["requests"]
        assert 0 < ttft < 30, ttft
    assert delta("manylora_request_errors_total", adapter="other", code="NOT_FOUND") == 1
    names = {name for name, _ in after}
    for family, (kind, _, _) in gm.FAMILIES.items():
        expected = f"{family}_count" if kind == "HISTOGRAM" else family
        assert expected in names, family
    assert _get(after, "manylora_pool_pages", use="free") > 0
    total = sum(_get(after, "manylora_pool_pages", use=u) for u in ("kv", "adapters", "free"))
    assert total == client.stats()["pool_pages_total"]
    assert _get(after, "manylora_adapters_resident") >= 1
    assert _get(after, "manylora_adapter_loads_total") >= 1
    assert _get(after, "manylora_requests_running") == 0 and _get(after, "manylora_requests_waiting") == 0
    assert _get(after, "manylora_adapter_load_seconds_count") == _get(after, "manylora_host_cache_loads_total")
    # on the CPU every step is eager (no CUDA graphs): each request's prefill and its decode steps at least
    stats = client.stats()
    assert delta("manylora_steps_total", kind="eager") >= sum(c["requests"] for c in sent.values())
    assert _get(after, "manylora_steps_total", kind="eager") == stats["steps_eager"] == stats["steps"]
    assert _get(after, "manylora_steps_total", kind="decode_graph") == 0
    assert _get(after, "manylora_mixed_step_buckets") == 0 and stats["mixed_step_buckets"] == []
    # the loop's time: steps ran while the requests did; the series lag the engine by at most a poll
    assert delta("manylora_engine_loop_seconds_total", part="step") > 0
    for key, part in gm.LOOP_PARTS.items():
        assert 0 <= _get(after, "manylora_engine_loop_seconds_total", part=part) <= stats[key], part


@pytest.mark.e2e
def test_adapter_label_cardinality_is_bounded(admin_server):
    """metrics_adapter_labels=3 on the admin server: more adapters than that share "other"."""
    client = admin_server.client()
    for adapter in sorted(admin_server.catalogue):  # 4 adapters
        client.generate("The river", adapter=adapter, max_tokens=2)
    time.sleep(1.2)  # the poller flushes the buffered events every 0.5 s
    samples = scrape(admin_server)
    labels = {dict(lab).get("adapter") for name, lab in samples if name == "manylora_requests_total"}
    assert "other" in labels and len(labels - {"other", "base"}) <= 3, labels

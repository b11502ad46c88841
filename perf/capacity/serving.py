"""The server's part of a capacity call: start tritonserver, warm it up, then its offline runs, sweep and soak.

Everything goes through one server and one pool of client processes (perf/capacity/clients.py), so the
targets ``server_stream``, ``server_nostream`` and ``llm`` of a call share a server start. Results go to
the call's store (perf/capacity/command.py ``Call``), which writes the summary after every run.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from manylora.client.api import ManyLoraClient
from perf.capacity.clients import ClientPool, ServerDriver, ServerLacksIgnoreEos
from perf.capacity.config import SERVER_TARGETS
from perf.capacity.engine_counters import run_counters
from perf.capacity.graph_check import graph_warnings
from perf.capacity.metrics import ClientLoad, OfflineResult
from perf.capacity.process_cpu import CpuReading
from perf.capacity.requests import CapacityRequest, ScheduledRequest
from perf.capacity.runs import log, measure_offline, measure_sweep_point
from perf.capacity.server import ServerConfig, TritonServer, http_get
from perf.capacity.soak import SoakConfig, run_soak
from perf.engine.checkpoint import SHAPES

if TYPE_CHECKING:
    from perf.capacity.command import Call


def _seconds(value: float | None, infinite: bool = False) -> str:
    return "inf" if infinite else "-" if value is None else f"{value:.3f} s"


class ServerPart:
    """The server targets of one call (``call``: its config, checkpoint, store, budget and output folders)."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.cfg = call.cfg
        self._stats_client: ManyLoraClient | None = None  # the server's engine counters, once it runs
        self._server_pid: int | None = None  # the root of the processes whose CPU each run reads

    def run(self) -> None:
        call, cfg = self.call, self.cfg
        offline = [t for t in SERVER_TARGETS if t in cfg.targets] if "offline" in cfg.parts else []
        sweep = "sweep" in cfg.parts and cfg.sweep_target in cfg.targets
        swept = ("engine", cfg.sweep_target)
        unswept = [t for t in cfg.targets if t not in swept] if "sweep" in cfg.parts else []
        if unswept:
            call.store.add("notes", f"the sweep covers {', '.join(swept)} only, not {', '.join(unswept)}")
        soak = "soak" in cfg.parts
        if not (offline or sweep or soak):
            return
        params = {k: str(v) for k, v in {**cfg.engine_params, "device": call.ckpt.device}.items()}
        server = TritonServer(ServerConfig(Path(call.ckpt.base_dir), Path(call.ckpt.catalogue), params,
                                           call.workdir / "server", call.logs / "server.log",
                                           cfg.server_start_timeout_s))
        log("starting tritonserver")
        server.start()
        info = json.loads(http_get(f"{server.http_url}/v2") or "{}")
        call.store.data["servers"].append({"call": call.index, "ready_s": round(server.ready_s, 1),
                                           "version": info.get("version"), "params": params})
        log(f"tritonserver {info.get('version')} ready in {server.ready_s:.1f} s on {server.grpc_url}")
        self._stats_client = ManyLoraClient(server.grpc_url, server.http_url, timeout=30)
        self._server_pid = server.pid
        for message in self._graph_warnings(server, params):
            log(f"warning: {message}")
            call.warn(f"server {message}")
        pool = None
        try:
            pool = ClientPool(server.grpc_url, call.client_config)
            self._warm_up(pool)
            for target in offline:
                self._offline(pool, target)
            if sweep:
                self._sweep(pool)
            if soak:
                self._soak(server, pool)
        finally:
            if pool is not None:
                pool.close()
            code = server.stop()
            log(f"tritonserver stopped ({code}); log in {call.logs / 'server.log'}")
            call.write()

    def _warm_up(self, pool: ClientPool) -> None:
        """A few requests of several sizes through the generator, streaming and not (compilation, first adapter
        loads); also where a server without the ignore_eos input is found out (ServerLacksIgnoreEos)."""
        vocab = SHAPES[self.cfg.shape].vocab
        names = [None, None, None, "lora-0000", "lora-0001"] if max(self.cfg.adapters) >= 2 else [None] * 3
        longest = self.cfg.request_set.max_model_len - 16
        sizes = [8, min(100, longest), min(300, longest), 16, 16]
        schedule = [
            ScheduledRequest(i, 0.0, CapacityRequest(i, tuple(4 + (7 * j) % (vocab - 4) for j in range(n)), 8, a))
            for i, (n, a) in enumerate(zip(sizes, names, strict=False))
        ]
        for stream in (True, False):
            outcome = ServerDriver(pool, stream=stream).run(schedule, cap_s=600, keep_ids=False)
            bad = next((r.error for r in outcome.records if r.error), None)
            if bad:
                raise RuntimeError(f"the server's warm-up failed: {bad}")

    def _driver(self, pool: ClientPool, target: str) -> ServerDriver | None:
        if target != "llm":
            return ServerDriver(pool, model="generator", stream=target == "server_stream")
        driver = ServerDriver(pool, model="llm", stream=True)
        probe = [ScheduledRequest(0, 0.0, CapacityRequest(0, (4, 5, 6, 7), 4, None))]  # also its warm-up
        try:
            driver.run(probe, cap_s=120, keep_ids=False)
        except ServerLacksIgnoreEos:
            self.call.skip("llm: the server refused ignore_eos, so its output lengths would not match the other "
                           "targets'; not measured")
            return None
        return driver

    def _graph_warnings(self, server: TritonServer, params: dict[str, str]) -> list[str]:
        """graph_check's warnings for the server's engine, from its ``stats`` (the generator's control input)."""
        from manylora.engine.config import EngineConfig
        from manylora.engine.model_config import ModelConfig

        if not params.get("device", "").startswith("cuda"):
            return []  # no CUDA graphs
        base = Path(self.call.ckpt.base_dir)
        try:
            stats = ManyLoraClient(server.grpc_url, server.http_url, timeout=30).stats()
        except Exception as e:  # noqa: BLE001 - the check must not stop the measurement
            return [f"its stats could not be read ({e}), so whether its CUDA graphs were captured is not known"]
        config = EngineConfig.from_strings({k: v for k, v in params.items() if k != "device"}, model_dir=str(base),
                                           device=params.get("device", "cpu"))
        is_moe = ModelConfig.from_dict(json.loads((base / "config.json").read_text())).is_moe
        return graph_warnings(config, config.device, is_moe, stats.get("mixed_step_buckets", []))

    def _measure_offline(self, driver: ServerDriver, target: str, n: int) -> OfflineResult | None:
        call = self.call
        if not call.budget.allows(0):
            call.skip(f"{target} offline n={n}: the time budget was spent")
            return None
        before = self._engine_stats()
        cpu = CpuReading.now(self._server_pid) if self._server_pid is not None else None
        result, records = measure_offline(driver, target, n, call.requests(n),
                                          cap_s=call.budget.cap(self.cfg.offline_cap_s),
                                          keep_ids=self.cfg.keep_output_ids, runs_dir=call.runs)
        if cpu is not None:
            result.meta["process_cores"] = cpu.cores_since()
        after = self._engine_stats()
        if before and after:
            result.meta["engine_counters"] = run_counters(before, after)
        if target == "llm":
            result.notes.append("each response asked for every output of the ensemble, as the OpenAI front does; "
                                "its tokens are its num_output_tokens")
        call.warn_clients(f"{target} n={n} offline", [ClientLoad(**c) for c in result.meta["clients"]])
        digests = None
        if target != "llm":  # token identity with the engine (text has no token ids)
            digests = [None] * len(records)
            for r in records:
                digests[r.request] = r.output_digest
        call.put_offline(asdict(result), digests)
        call.write()
        cores = result.meta.get("process_cores") or {}
        log(f"{target} offline n={n}: {result.completed}/{result.requests} in {result.wall_s:.1f} s, "
            f"{result.req_per_s:.2f} req/s, {result.output_tok_per_s:,.0f} tok/s, busiest client "
            f"{result.client_cpu_max or 0:.2f} of a core"
            + ("; server cores: " + ", ".join(f"{role} {c:.2f}" for role, c in cores.items() if c >= 0.01)
               if cores else ""))
        return result

    def _engine_stats(self) -> dict:
        """The server's engine's counters (its stats), or {} with a warning where they cannot be read."""
        try:
            return self._stats_client.stats() if self._stats_client is not None else {}
        except Exception as e:  # noqa: BLE001 - the counters must not stop the measurement
            self.call.warn(f"the server's engine counters could not be read ({e})")
            return {}

    def _offline(self, pool: ClientPool, target: str) -> None:
        driver = self._driver(pool, target)
        if driver is not None:
            for n in self.cfg.adapters:
                self._measure_offline(driver, target, n)

    def _capacity(self, driver: ServerDriver, target: str, part: str) -> float | None:
        """The target's offline req/s at the sweep's adapter count: from the store, or measured now."""
        n = self.cfg.sweep_adapters
        capacity = self.call.store.capacity(target, n)
        if capacity is None:
            self.call.store.add("notes", f"{target} offline n={n} measured in call {self.call.index} for the "
                                         f"{part}'s capacity")
            result = self._measure_offline(driver, target, n)
            capacity = result.req_per_s if result and result.completed else None
        return capacity

    def _sweep(self, pool: ClientPool) -> None:
        call = self.call
        target, n, sweep = self.cfg.sweep_target, self.cfg.sweep_adapters, call.sweep_config
        driver = self._driver(pool, target)
        capacity = None if driver is None else self._capacity(driver, target, "sweep")
        if capacity is None:
            call.skip(f"{target} sweep: no capacity")
            return
        requests = call.requests(n)
        for fraction in sweep.fractions:
            if not call.budget.allows(sweep.duration_s + sweep.drain_s):
                call.skip(f"{target} sweep x{fraction:g}: the time budget was spent")
                continue
            point = measure_sweep_point(driver, target, n, requests, capacity, fraction, sweep, call.runs)
            point.notes.append(f"capacity {capacity:.3f} req/s")
            call.warn_clients(f"{target} sweep x{fraction:g}", [], point.send_lag_p99)
            if point.client_cpu_max is not None and point.client_cpu_max >= call.client_config.saturated_at:
                call.warn(f"{target} sweep x{fraction:g}: a client process used {point.client_cpu_max:.2f} of a "
                          f"core: raise --client-processes")
            call.store.put_sweep(asdict(point), call.index)
            call.write()
            log(f"{target} sweep x{fraction:g} ({point.offered_rps:.2f} req/s): achieved {point.achieved_rps:.2f} "
                f"req/s, TTFT p99 {_seconds(point.ttft_p99, point.ttft_inf)}, knee criteria "
                f"{'met' if point.qualifies else 'missed'}")

    def _soak(self, server: TritonServer, pool: ClientPool) -> None:
        call, cfg = self.call, self.cfg
        target, n = cfg.soak_target, cfg.sweep_adapters
        driver = self._driver(pool, target)
        capacity = None if driver is None else self._capacity(driver, target, "soak")
        soak = SoakConfig(cfg.soak_s, cfg.soak_fraction, cfg.soak_interval_s)
        if capacity is None or not call.budget.allows(soak.duration_s + soak.drain_s):
            call.skip(f"soak: {'no capacity' if capacity is None else 'the time budget was spent'}")
            return
        log(f"soak: {soak.duration_s:g} s at {soak.fraction:g} x {capacity:.2f} req/s")
        result = run_soak(driver, target, n, call.requests(n), capacity, soak, server.pid, call.runs)
        call.store.put_soak(result, call.index)
        total = result["memory"].get("host_rss", {}).get("total", {})
        log(f"soak: host RSS {total.get('start_mb')} -> {total.get('end_mb')} MB, max {total.get('max_mb')}, "
            f"slope {total.get('slope_mb_per_min')} MB/min")
        call.write()

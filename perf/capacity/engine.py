"""The in-process engine as a capacity target, run in a child process of perf/capacity/command.py.

    python -m perf.capacity.engine PLAN.json

The child loads manylora.engine.scheduling.engine.Engine on the plan's checkpoint and catalogue (as
perf/engine/engine_target.py
does: greedy, ignore_eos, max_tokens = the request's output length), warms it up, runs the plan's
offline runs and sweep, and writes the results JSON after every run (a killed child leaves what it
finished). Running it in its own process means the GPU is free again when it exits, before the server
or vLLM start.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from perf.capacity.engine_counters import run_counters
from perf.capacity.graph_check import graph_warnings
from perf.capacity.metrics import UNFINISHED, digest
from perf.capacity.process_cpu import CpuReading
from perf.capacity.requests import RequestSetConfig, ScheduledRequest, build_requests
from perf.capacity.runs import Budget, RunOutcome, SweepConfig, measure_offline, measure_sweep_point, new_record
from perf.engine.engine_target import wait_idle

TARGET = "engine"


@dataclass
class EnginePlan:
    """What the engine child does (written as JSON by the parent).

    Attributes:
        base_dir, catalogue: the checkpoint and the catalogue JSON (name -> adapter directory).
        device: "cpu", "cuda", "auto".
        engine: EngineConfig keyword arguments besides model_dir, adapters and device.
        requests: RequestSetConfig fields.
        offline_adapters: adapter counts of the offline runs, in order.
        sweep_adapters: the adapter count of the sweep; None: no sweep.
        sweep: SweepConfig fields.
        capacity_rps: the engine's capacity at sweep_adapters if known; None: this plan's offline run of it.
        offline_cap_s: an offline run is cancelled after this long.
        keep_ids: keep output token ids in the records (a digest is always kept).
        runs_dir: per-request JSONL files go here.
        results: the results JSON.
        deadline: time.monotonic() after which no further run starts.
    """

    base_dir: str
    catalogue: str
    device: str
    engine: dict
    requests: dict
    offline_adapters: list[int]
    sweep_adapters: int | None
    sweep: dict
    capacity_rps: float | None
    offline_cap_s: float
    keep_ids: bool
    runs_dir: str
    results: str
    deadline: float
    warm_up: bool = True
    skipped: list[str] = field(default_factory=list)


class EngineDriver:
    """Sends a schedule to a running Engine from a timer thread; token times from its emit callback."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._runs = 0

    def run(self, schedule: list[ScheduledRequest], *, cap_s: float, keep_ids: bool) -> RunOutcome:
        from manylora.engine.errors import RequestError
        from manylora.engine.requests.types import GenerationOutput, GenerationRequest, SamplingParams

        self._runs += 1
        records = [new_record(s) for s in schedule]
        ids: list[list[int]] = [[] for _ in schedule]
        lock = threading.Lock()
        all_done = threading.Event()
        cancelled = threading.Event()
        state = {"open": len(schedule), "closed": False}
        t0 = time.monotonic()

        def finish(i: int, t: float, error: str | None) -> None:
            with lock:
                if state["closed"] or records[i].end_s is not None:
                    return
                records[i].end_s, records[i].error = t, error
                state["open"] -= 1
                if state["open"] == 0:
                    all_done.set()

        def emitter(i: int):
            def emit(out: GenerationOutput) -> None:
                t = time.monotonic() - t0
                if state["closed"]:
                    return
                records[i].add_chunk(t, len(out.token_ids))
                ids[i].extend(out.token_ids)
                if out.finished:
                    finish(i, t, None if out.error is None else f"{out.error.code.value}: {out.error.message}")

            return emit

        def send() -> None:
            for i, item in enumerate(schedule):
                delay = t0 + item.offset_s - time.monotonic()
                if delay > 0 and cancelled.wait(delay):
                    return
                r = item.request
                records[i].send_s = time.monotonic() - t0
                request = GenerationRequest(
                    request_id=f"cap{self._runs}-{item.index}",
                    prompt_ids=list(r.prompt_ids),
                    adapter=r.adapter,
                    sampling=SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                    is_cancelled=cancelled.is_set,
                )
                try:
                    self.engine.submit(request, emitter(i))
                except RequestError as e:
                    finish(i, time.monotonic() - t0, f"{e.code.value}: {e.message}")

        sender = threading.Thread(target=send, name="capacity-sender", daemon=True)
        sender.start()
        if not schedule:
            all_done.set()
        finished = all_done.wait(max(0.0, t0 + cap_s - time.monotonic()))
        with lock:
            state["closed"] = True
        cancelled.set()
        sender.join()
        end = max((r.end_s for r in records if r.end_s is not None), default=0.0) if finished else cap_s
        for rec, got in zip(records, ids, strict=True):
            if rec.end_s is None and rec.send_s is not None:
                rec.error = UNFINISHED
            rec.output_digest = digest(got)
            if keep_ids:
                rec.output_ids = got
        if not finished:
            wait_idle(self.engine, 60.0)
        return RunOutcome(records=records, end_s=end, capped=not finished)


def warm_up(engine) -> None:
    """Requests of several sizes, with and without adapters, so that compilation and first loads are not timed."""
    from manylora.engine.requests.types import GenerationRequest, SamplingParams
    from manylora.engine.scheduling.offline import generate

    vocab = engine.model_config.vocab_size
    names = engine.catalogue.names()[:3]
    sizes = [(8, None), (100, names[0] if names else None), (300, None)] + [(16, a) for a in names]
    requests = [
        GenerationRequest(
            f"warm-{i}", [4 + (7 * j) % (vocab - 4) for j in range(n)], a, SamplingParams(max_tokens=8, ignore_eos=True)
        )
        for i, (n, a) in enumerate(sizes)
        if n + 8 <= engine.max_len
    ]
    generate(engine, requests, timeout=600)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def _log(message: str) -> None:
    print(f"[capacity engine {time.strftime('%H:%M:%S')}] {message}", flush=True)


def execute(plan: EnginePlan) -> dict:
    """Load the engine, run the plan, write and return the results."""
    from manylora.engine.config import EngineConfig
    from manylora.engine.devices import resolve_device
    from manylora.engine.scheduling.engine import Engine

    device = resolve_device(plan.device)
    results: dict = {"device": device, "device_name": device_name(device), "offline": [], "sweep": [],
                     "skipped": list(plan.skipped), "timings": {}, "notes": []}
    out = Path(plan.results)

    def save() -> None:
        out.write_text(json.dumps(results, indent=1) + "\n")

    save()
    t = time.monotonic()
    knobs = {k: str(v) for k, v in plan.engine.items()}  # as the server's config.pbtxt gives them
    engine = Engine(EngineConfig.from_strings(knobs, model_dir=plan.base_dir, device=device))
    catalogue = json.loads(Path(plan.catalogue).read_text())
    errors = engine.catalogue.register_all(catalogue, strict=False, workers=max(4, os.cpu_count() or 4))
    if errors:
        raise RuntimeError(f"{len(errors)} adapters refused, e.g. {next(iter(errors.values()))}")
    results["timings"]["engine_load_s"] = round(time.monotonic() - t, 2)
    _log(f"engine on {device} with {len(catalogue)} adapters in {results['timings']['engine_load_s']} s")
    results["warnings"] = graph_warnings(engine.config, engine.device, engine.model.cfg.is_moe,
                                         engine.stats()["mixed_step_buckets"])
    for message in results["warnings"]:
        _log(f"warning: {message}")
    try:
        if plan.warm_up:
            t = time.monotonic()
            warm_up(engine)
            results["timings"]["warm_up_s"] = round(time.monotonic() - t, 2)
        driver = EngineDriver(engine)
        request_config = RequestSetConfig(**{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in plan.requests.items()})
        runs_dir = Path(plan.runs_dir)
        budget = Budget(plan.deadline)
        capacity = plan.capacity_rps
        for n in plan.offline_adapters:
            if not budget.allows(0):
                results["skipped"].append(f"engine offline n={n}: the time budget was spent")
                continue
            before, cpu = engine.stats(), CpuReading.now(os.getpid())
            result, _ = measure_offline(driver, TARGET, n, build_requests(request_config, n),
                                        cap_s=budget.cap(plan.offline_cap_s), keep_ids=plan.keep_ids,
                                        runs_dir=runs_dir)
            result.meta["process_cores"] = cpu.cores_since()
            after = engine.stats()
            result.meta["engine_stats"] = _stats(after)
            result.meta["engine_counters"] = run_counters(before, after)
            results["offline"].append(asdict(result))
            save()
            _log(f"offline n={n}: {result.completed}/{result.requests} in {result.wall_s:.1f} s, "
                 f"{result.req_per_s:.2f} req/s, {result.output_tok_per_s:.0f} tok/s")
            if n == plan.sweep_adapters and result.completed:
                capacity = result.req_per_s
        if plan.sweep_adapters is not None:
            sweep = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan.sweep.items()})
            requests = build_requests(request_config, plan.sweep_adapters)
            if not capacity:
                results["skipped"].append("engine sweep: no capacity measured or given")
                sweep = None
            for fraction in sweep.fractions if sweep else ():
                if not budget.allows(sweep.duration_s + sweep.drain_s):
                    results["skipped"].append(f"engine sweep x{fraction:g}: the time budget was spent")
                    continue
                point = measure_sweep_point(driver, TARGET, plan.sweep_adapters, requests, capacity, fraction,
                                            sweep, runs_dir)
                point.notes.append(f"capacity {capacity:.3f} req/s")
                results["sweep"].append(asdict(point))
                save()
                p99 = "inf" if point.ttft_inf else "-" if point.ttft_p99 is None else f"{point.ttft_p99:.3f} s"
                _log(f"sweep x{fraction:g} ({point.offered_rps:.2f} req/s offered): achieved {point.achieved_rps:.2f} "
                     f"req/s, TTFT p99 {p99}, knee criteria {'met' if point.qualifies else 'missed'}")
        results["engine_stats"] = _stats(engine.stats())
        save()
    finally:
        engine.shutdown()
    return results


def _stats(s: dict) -> dict:
    """The graph and adapter counters of ``Engine.stats()`` the results keep (since the engine started)."""
    keys = ("steps", "steps_decode_graph", "steps_mixed_graph", "steps_eager", "mixed_step_buckets", "preemptions",
            "adapter_uploads", "adapter_evictions")
    return {k: s[k] for k in keys if k in s}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    plan = EnginePlan(**json.loads(Path(args[0]).read_text()))
    execute(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where an engine run's time goes: per-step timings of scheduling, batch building, the forward pass
(graph replay or eager), sampling, adapter uploads, Triton compilations and idle waits on adapter loads.

    python -m perf.engine.profile_engine --shape llama3-8b --adapters 0 5 100 --rate 24 --duration 20
    python -m perf.engine.profile_engine --shape tiny --device cpu --adapters 0 5 --duration 4   # smoke test

Replays the headline's S-LoRA trace (same generator, same seed) against one engine for each
adapter count (0 = base only) and wraps the engine's step phases with timers that synchronise
the device, so each phase's wall time is its own. Prints a table per run and writes
<out>/profile.json with every step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from manylora.engine.config import DECODE_FORMS
from perf.engine.checkpoint import SHAPES, write_adapter_catalogue, write_base
from perf.workload.runner import run_target
from perf.workload.trace import WorkloadConfig, adapter_name, base_only, generate_trace


@dataclass
class StepRecord:
    kind: str  # "graph" (decode graph), "mixed" (mixed-step graph), "eager", "idle" (nothing ran: adapters loading)
    tokens: int
    seqs: int
    adapters: int
    schedule_s: float = 0.0
    build_s: float = 0.0
    forward_s: float = 0.0
    forward_cpu_s: float = 0.0  # until the forward call returned (launches), before the device caught up
    sample_s: float = 0.0
    upload_s: float = 0.0
    step_s: float = 0.0  # the whole step, phases and the rest
    compiles: int = 0


@dataclass
class RunProfile:
    name: str
    wall_s: float
    completed: int
    sent: int
    steps: list[StepRecord] = field(default_factory=list)
    adapter_loads: int = 0
    adapter_load_s: float = 0.0
    loop_s: dict[str, float] = field(default_factory=dict)  # engine-loop work outside steps

    def summary(self) -> dict:
        steps = self.steps
        kinds = Counter(s.kind for s in steps)
        phases = ("schedule_s", "build_s", "forward_s", "sample_s", "upload_s", "step_s")
        total = {p: sum(getattr(s, p) for s in steps) for p in phases}
        by_kind = {}
        for kind in ("graph", "mixed", "eager"):
            sel = [s for s in steps if s.kind == kind]
            if sel:
                by_kind[kind] = {
                    "steps": len(sel),
                    "mean_ms": 1e3 * sum(s.forward_s for s in sel) / len(sel),
                    "mean_cpu_ms": 1e3 * sum(s.forward_cpu_s for s in sel) / len(sel),
                    "mean_tokens": sum(s.tokens for s in sel) / len(sel),
                    "mean_seqs": sum(s.seqs for s in sel) / len(sel),
                    "mean_adapters": sum(s.adapters for s in sel) / len(sel),
                }
        slow = sorted(steps, key=lambda s: -s.forward_s)[:8]
        return {
            "name": self.name,
            "wall_s": self.wall_s,
            "completed": self.completed,
            "sent": self.sent,
            "steps": dict(kinds),
            "phase_totals_s": {k: round(v, 3) for k, v in total.items()},
            "by_kind": by_kind,
            "compiles": sum(s.compiles for s in steps),
            "steps_over_100ms": sum(1 for s in steps if s.forward_s > 0.1),
            "loop_s": {k: round(v, 3) for k, v in self.loop_s.items()},
            "adapter_loads": self.adapter_loads,
            "adapter_load_s": round(self.adapter_load_s, 2),
            "slowest": [asdict(s) for s in slow],
        }


class CompileCounter:
    """Counts Triton JIT compilations through triton's post-compile hook, where this triton has one."""

    def __init__(self) -> None:
        self.count = 0
        self._installed = False
        try:
            from triton import knobs

            previous = knobs.runtime.jit_post_compile_hook

            def hook(*args, **kwargs):
                self.count += 1
                return previous(*args, **kwargs) if previous else None

            knobs.runtime.jit_post_compile_hook = hook
            self._installed = True
        except (ImportError, AttributeError):
            pass

    @property
    def available(self) -> bool:
        return self._installed


class StepProfiler:
    """Wraps an engine's step phases with synchronising timers; one StepRecord per step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # trace_eager_steps(): eager steps to record with torch.profiler (kernels and host ops)
        self.trace_steps, self.trace_min_adapters, self.trace_out, self.traced = 0, 1, None, 0
        self.python_profile: cProfile.Profile | None = None  # profile_python(): every step's Python functions
        self.records: list[StepRecord] = []
        self.compiles = CompileCounter()
        self._current: StepRecord | None = None
        self.loop_s: Counter[str] = Counter()
        self._sync = torch.cuda.synchronize if engine.device.startswith("cuda") else (lambda: None)
        self._wrap_all()

    def _timed(self, obj, attr: str, phase: str, cpu_phase: str | None = None) -> None:
        inner = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            self._sync()
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                launched = time.perf_counter()
                self._sync()
                if self._current is not None:
                    setattr(self._current, phase, getattr(self._current, phase) + time.perf_counter() - t)
                    if cpu_phase:
                        setattr(self._current, cpu_phase, getattr(self._current, cpu_phase) + launched - t)

        setattr(obj, attr, wrapper)

    def _wrap_all(self) -> None:
        e = self.engine
        self._timed(e.scheduler, "schedule", "schedule_s")
        for attr in ("gather", "step_batch", "lora_batch", "graph_inputs"):
            self._timed(e.steps, attr, "build_s")
        self._timed(e.model, "forward", "forward_s", "forward_cpu_s")
        if e.graphs is not None:
            self._timed(e.graphs, "run", "forward_s", "forward_cpu_s")
        if e.mixed_graphs is not None:
            self._timed(e.mixed_graphs, "run", "forward_s", "forward_cpu_s")
            self._timed(e.steps, "mixed_inputs", "build_s")
        self._timed(e, "_advance", "sample_s")  # sampling (waits for the device), tokens, outputs
        self._timed(e.adapters, "make_resident", "upload_s")
        for attr in ("_prefetch", "_drop_cancelled", "_drain_inbox"):
            self._loop_timed(attr)
        step = e.step

        def profiled_step():
            running_before = len(e.scheduler.running)
            record = StepRecord(kind="idle", tokens=0, seqs=running_before, adapters=0)
            self._current = record
            compiles = self.compiles.count
            replays = self._replays()
            plan_box: list = []
            schedule = e.scheduler.schedule

            def capture_plan():
                plan, failed = schedule()
                plan_box.append(plan)
                return plan, failed

            e.scheduler.schedule = capture_plan
            t = time.perf_counter()
            tracer = self._maybe_trace()
            if self.python_profile is not None:
                self.python_profile.enable()
            try:
                ran = step()
            finally:
                if self.python_profile is not None:
                    self.python_profile.disable()
                if tracer is not None:
                    self._finish_trace(tracer, plan_box)
                e.scheduler.schedule = schedule
                self._current = None
            record.step_s = time.perf_counter() - t
            plan = plan_box[0] if plan_box else []
            if plan:
                record.tokens = sum(c.num_tokens for c in plan)
                record.seqs = len(plan)
                record.adapters = len({c.sequence.adapter_key for c in plan if c.sequence.spec})
                decode, mixed = (after - before for after, before in zip(self._replays(), replays, strict=True))
                record.kind = "graph" if decode else "mixed" if mixed else "eager"
            record.compiles = self.compiles.count - compiles
            if plan or not ran:
                self.records.append(record)
            return ran

        e.step = profiled_step

    def _replays(self) -> tuple[int, int]:
        """Steps replayed so far from the decode graphs and from the mixed-step graphs."""
        e = self.engine
        return (sum(e.graphs.replays.values()) if e.graphs is not None else 0,
                sum(e.mixed_graphs.replays.values()) if e.mixed_graphs is not None else 0)

    def trace_eager_steps(self, steps: int, min_adapters: int, out: Path) -> None:
        """Record the next ``steps`` eager steps with at least ``min_adapters`` adapters into ``out``."""
        self.trace_steps, self.trace_min_adapters, self.trace_out, self.traced = steps, min_adapters, out, 0
        out.unlink(missing_ok=True)

    def profile_python(self) -> None:
        """From now on, run every step under cProfile (the engine thread's Python functions, host time)."""
        self.python_profile = cProfile.Profile()

    def write_python_profile(self, out: Path, limit: int = 45) -> None:
        """The profiled steps' functions by own time and by cumulative time into ``out``."""
        if self.python_profile is None:
            return
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            text.write(f"\n-- by {key}\n")
            pstats.Stats(self.python_profile, stream=text).sort_stats(key).print_stats(limit)
        out.write_text(text.getvalue())
        self.python_profile = None

    def _maybe_trace(self):
        """A started torch.profiler for this step while traces are wanted and the waiting batch looks
        eager (prefill pending) with enough adapters; else None."""
        e = self.engine
        if self.traced >= self.trace_steps or self.trace_out is None:
            return None
        waiting = list(e.scheduler.waiting) + list(e.scheduler.running)
        if len({s.adapter_key for s in waiting if s.spec}) < self.trace_min_adapters:
            return None
        if not any(s.num_computed < s.num_tokens() - 1 for s in waiting):
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if e.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        tracer = torch.profiler.profile(activities=activities)
        tracer.start()
        return tracer

    def _finish_trace(self, tracer, plan_box: list) -> None:
        self._sync()
        tracer.stop()
        plan = plan_box[0] if plan_box else []
        if not plan or self.engine.steps.is_decode_only(plan):
            return
        self.traced += 1
        averages = tracer.key_averages()
        device_key = "self_device_time_total" if self.engine.device.startswith("cuda") else "self_cpu_time_total"
        adapters = len({c.sequence.adapter_key for c in plan if c.sequence.spec})
        header = (f"\n#### traced eager step {self.traced}: {sum(c.num_tokens for c in plan)} tokens, "
                  f"{len(plan)} seqs, {adapters} adapters\n")
        text = (header + "-- by device time\n" + averages.table(sort_by=device_key, row_limit=18)
                + "-- by host time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=18))
        with open(self.trace_out, "a") as f:
            f.write(text)

    def _loop_timed(self, attr: str) -> None:
        inner = getattr(self.engine, attr)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.loop_s[attr] += time.perf_counter() - t

        setattr(self.engine, attr, wrapper)

    def take(self) -> tuple[list[StepRecord], dict[str, float]]:
        records, self.records = self.records, []
        loop, self.loop_s = dict(self.loop_s), Counter()
        return records, loop


def main(argv: list[str] | None = None) -> None:
    from manylora.engine.config import EngineConfig
    from manylora.engine.devices import resolve_device
    from manylora.engine.scheduling.engine import Engine
    from perf.engine.engine_target import EngineTarget
    from perf.engine.headline import DEFAULTS, _warm_up

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 5, 100])
    p.add_argument("--distinct-adapters", type=int, default=8)
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--drain", type=float, default=20.0)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--admit-every-steps", type=int, default=1)
    p.add_argument("--prefill-attention", choices=["sdpa", "paged"], default="sdpa")
    p.add_argument("--decode-lora-kernels", choices=list(DECODE_FORMS), default="bgmv")
    p.add_argument("--no-mixed-step-graphs", action="store_false", dest="mixed_step_graphs",
                   help="run prefill and mixed steps eagerly (EngineConfig.mixed_step_graphs=False)")
    p.add_argument("--mixed-step-buckets", default="", help="EngineConfig.mixed_step_buckets ('': the default)")
    p.add_argument("--adapter-load-processes", type=int, default=None,
                   help="EngineConfig.adapter_load_processes (default: the engine's, by device)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="record this many eager steps of the last adapter count with torch.profiler "
                        "(top ops by device and host time to <out>/trace.txt)")
    p.add_argument("--trace-min-adapters", type=int, default=8)
    p.add_argument("--python-profile", action="store_true",
                   help="run the last adapter count's steps under cProfile (host time by Python function, "
                        "to <out>/python_profile.txt; slows the run)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/profile"))
    a = p.parse_args(argv)
    d = DEFAULTS[a.shape]
    rate, duration = a.rate or d["rate"], a.duration or d["duration_s"]
    max_num_seqs = a.max_num_seqs or d["max_num_seqs"]
    shape = SHAPES[a.shape]
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles: list[RunProfile] = []
    with tempfile.TemporaryDirectory(prefix="manylora-profile-") as tmp:
        root = Path(tmp)
        base_dir = write_base(root / "base", shape, dtype=dtype, device=device if device != "cpu" else "cpu")
        n_max = max(max(a.adapters), 1)
        catalogue = write_adapter_catalogue(root / "adapters", shape, [adapter_name(i) for i in range(n_max)],
                                            distinct=a.distinct_adapters, rank=16, dtype=dtype,
                                            device=device if device != "cpu" else "cpu", base_dir=str(base_dir))
        engine = Engine(EngineConfig(
            model_dir=str(base_dir), device=device, max_lora_rank=16, max_num_seqs=max_num_seqs,
            max_loras=max_num_seqs, max_cpu_loras=d.get("max_cpu_loras"),
             admit_every_steps=a.admit_every_steps,
            prefill_attention=a.prefill_attention, adapter_load_processes=a.adapter_load_processes,
            decode_lora_kernels=a.decode_lora_kernels, mixed_step_graphs=a.mixed_step_graphs,
            mixed_step_buckets=a.mixed_step_buckets, max_model_len=d["input_range"][1] + d["output_range"][1] + 8))
        errors = engine.catalogue.register_all(catalogue, strict=False, workers=max(4, os.cpu_count() or 4))
        if errors:
            raise RuntimeError(f"{len(errors)} adapters refused, e.g. {next(iter(errors.values()))}")
        _warm_up(engine)
        profiler = StepProfiler(engine)
        profiler.take()
        print(f"compile counter: {'on' if profiler.compiles.available else 'not available in this triton'}")
        for n in a.adapters:
            if a.trace_steps and n == a.adapters[-1]:
                profiler.trace_eager_steps(a.trace_steps, a.trace_min_adapters, out / "trace.txt")
            if a.python_profile and n == a.adapters[-1]:
                profiler.profile_python()
            trace = generate_trace(WorkloadConfig(
                num_adapters=max(n, 1), alpha=1.0, rate=rate, cv=1.0, duration_s=duration,
                input_range=d["input_range"], output_range=d["output_range"], seed=0, vocab_range=(4, shape.vocab)))
            if n == 0:
                trace = base_only(trace)
            name = "base-only" if n == 0 else f"n={n}"
            host = engine.adapters.host
            loads0, load_s0 = host.loads, host.load_seconds
            t0 = time.perf_counter()
            summary, _ = run_target(name, trace, EngineTarget(engine, name=name, run_id=name), None,
                                    max_duration_s=duration + a.drain, progress=False)
            steps, loop = profiler.take()
            prof = RunProfile(name, time.perf_counter() - t0, summary.completed, summary.sent, steps,
                              host.loads - loads0, host.load_seconds - load_s0, loop)
            profiles.append(prof)
            print_profile(prof.summary(), summary.req_per_s)
            profiler.write_python_profile(out / "python_profile.txt")
        engine.shutdown()
    (out / "profile.json").write_text(json.dumps(
        {"shape": a.shape, "device": device, "rate": rate, "duration_s": duration,
         "runs": [p.summary() for p in profiles],
         "steps": {p.name: [asdict(s) for s in p.steps] for p in profiles}}) + "\n")


def print_profile(s: dict, req_per_s: float) -> None:
    print(f"\n== {s['name']}: {s['completed']}/{s['sent']} done, {req_per_s:.2f} req/s, wall {s['wall_s']:.1f}s, "
          f"steps {s['steps']}, compiles {s['compiles']}, steps > 100 ms {s['steps_over_100ms']}, "
          f"adapter loads {s['adapter_loads']} ({s['adapter_load_s']}s of loader time)")
    print("   phase totals (s): " + ", ".join(f"{k[:-2]} {v}" for k, v in s["phase_totals_s"].items())
          + "; loop: " + ", ".join(f"{k.strip('_')} {v}" for k, v in s["loop_s"].items()))
    for kind, k in s["by_kind"].items():
        print(f"   {kind:5s}: {k['steps']} steps, {k['mean_ms']:.2f} ms mean forward ({k['mean_cpu_ms']:.2f} ms to "
              f"launch), {k['mean_tokens']:.0f} tokens, "
              f"{k['mean_seqs']:.0f} seqs, {k['mean_adapters']:.1f} adapters")
    for r in s["slowest"][:4]:
        print(f"   slow: {r['kind']} {r['forward_s'] * 1e3:.0f} ms, {r['tokens']} tokens, {r['seqs']} seqs, "
              f"{r['adapters']} adapters, {r['compiles']} compiles")


if __name__ == "__main__":
    main()

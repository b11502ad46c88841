"""Where a captured step's time goes, from a profiler trace of its kernels: base work, LoRA work alone, nothing.

The per-kernel totals of ``bench_decode_step --profile`` say what ran, not what the step waited on: with the LoRA
work on a side stream, a kernel's time beside a GEMM costs nothing unless the rest of the step ends up waiting for
it. ``split_step_time`` cuts the wall time of a trace into

* ``main_ms``: some kernel of the base model's work (everything not named ``*lora*``) is running, whatever the LoRA
  kernels do meanwhile;
* ``side_only_ms``: only LoRA kernels run: the step waits for its LoRA work (the critical path's cost of it);
* ``idle_ms``: no kernel runs at all: launch gaps between the graph's nodes and the host's copies between steps;

and charges each LoRA-only stretch to the base-work kernel that followed it (the consumer that waited: RMSNorm,
silu * up, RoPE + KV write). Kernels are told apart by name, not by stream: a CUDA graph maps its branches onto
streams of its own, so the stream a trace names is not the one the kernel was captured on (on the H200 a graph's
longest stream held both GEMMs and expands, 2026-12-02-h200/22_timeline).

    events = kernel_events(json.load(open("trace.json")))   # a torch.profiler chrome trace
    print(format_split(split_step_time(events, steps=5)))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["KernelEvent", "StepSplit", "format_split", "is_lora_kernel", "kernel_events", "split_step_time"]

_GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass(frozen=True)
class KernelEvent:
    """One GPU activity of a trace: start and end in microseconds, the stream it ran on."""

    name: str
    start_us: float
    end_us: float
    stream: int


@dataclass
class StepSplit:
    """A trace's wall time, per step, cut by what was running (see the module's docstring)."""

    steps: int
    wall_ms: float
    main_ms: float
    side_only_ms: float
    idle_ms: float
    side_kernel_ms: float  # the LoRA kernels' time, overlapped or not
    waits_ms: dict[str, float] = field(default_factory=dict)  # LoRA-only time charged to the kernel that followed


def kernel_events(trace: dict) -> list[KernelEvent]:
    """The GPU activities (kernels, copies, memsets) of a torch.profiler chrome trace (``export_chrome_trace``)."""
    events = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in _GPU_CATEGORIES:
            continue
        stream = e.get("args", {}).get("stream", e.get("tid"))
        start = float(e["ts"])
        events.append(KernelEvent(e.get("name", "?"), start, start + float(e.get("dur", 0.0)), int(stream)))
    return events


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _subtract(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (merged, sorted) ``intervals`` not inside the (merged, sorted) ``cover``."""
    out = []
    j = 0
    for start, end in intervals:
        cur = start
        while j < len(cover) and cover[j][1] <= cur:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > cur:
                out.append((cur, cover[k][0]))
            cur = max(cur, cover[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def is_lora_kernel(name: str) -> bool:
    """Whether a kernel is LoRA work (the shrink / expand kernels of manylora/kernels/lora_*.py)."""
    return "lora" in name.lower()


def split_step_time(events: list[KernelEvent], steps: int = 1,
                    is_side: Callable[[str], bool] = is_lora_kernel) -> StepSplit:
    """Cut the trace's span (first start to last end) into main / side-only / idle time, per step; ``is_side``
    names the side work (the LoRA kernels), everything else is the main work."""
    if not events:
        raise ValueError("the trace holds no GPU activity (did the profiler see the graph's kernels?)")
    main_events = [e for e in events if not is_side(e.name)]
    side_events = [e for e in events if is_side(e.name)]
    main_busy = _union([(e.start_us, e.end_us) for e in main_events])
    side_busy = _union([(e.start_us, e.end_us) for e in side_events])
    span_start = min(e.start_us for e in events)
    span_end = max(e.end_us for e in events)
    side_only = _subtract(side_busy, main_busy)
    # charge each side-only stretch to the main-work kernel that starts next
    followers = sorted(main_events, key=lambda e: e.start_us)
    waits: dict[str, float] = defaultdict(float)
    j = 0
    for start, end in side_only:
        while j < len(followers) and followers[j].start_us < end:
            j += 1
        name = followers[j].name if j < len(followers) else "(end of trace)"
        waits[name] += end - start
    wall = span_end - span_start
    busy = _length(_union(main_busy + side_busy))
    per = 1e3 * max(1, steps)
    return StepSplit(
        steps=steps,
        wall_ms=wall / per,
        main_ms=_length(main_busy) / per,
        side_only_ms=_length(side_only) / per,
        idle_ms=(wall - busy) / per,
        side_kernel_ms=sum(e.end_us - e.start_us for e in side_events) / per,
        waits_ms={k: v / per for k, v in sorted(waits.items(), key=lambda kv: -kv[1])},
    )


def format_split(split: StepSplit, top: int = 6) -> str:
    """A few lines: the per-step split and the kernels that waited longest for LoRA work."""
    lines = [
        f"   per step: {split.wall_ms:.3f} ms wall = {split.main_ms:.3f} base kernels running + "
        f"{split.side_only_ms:.3f} LoRA kernels alone + {split.idle_ms:.3f} no kernel running "
        f"(LoRA kernels {split.side_kernel_ms:.3f} ms, {split.steps} steps)"
    ]
    for name, ms in list(split.waits_ms.items())[:top]:
        lines.append(f"     waited {ms * 1e3:8.1f} us before {name[:80]}")
    return "\n".join(lines)

"""The capacity benchmark's configuration: targets, parts, per-shape defaults and the command line.

perf/capacity/command.py documents the benchmark; ``python -m perf.capacity --help`` lists the options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from perf.capacity.requests import RequestSetConfig
from perf.engine.checkpoint import SHAPES

TARGETS = ("engine", "server_stream", "server_nostream", "llm", "vllm")
SERVER_TARGETS = ("server_stream", "server_nostream", "llm")
PARTS = ("offline", "sweep", "soak")
LOAD_TARGETS = ("server_stream", "llm")  # the server targets an open-loop sweep or a soak can drive


@dataclass
class CapacityConfig:
    """One call of the capacity benchmark; per-shape defaults in :data:`DEFAULTS`.

    The request set (requests, input/output ranges, seed), the adapters (counts, rank, distinct files)
    and the engine knobs (max_num_seqs, max_loras, max_cpu_loras) are the same for every target; targets
    and parts pick what this call measures; sweep_*, soak_*, client_*, vllm_* shape those parts;
    offline_cap_s and budget_s bound the call's time; workdir holds the checkpoint and the results store.
    """

    shape: str = "tiny"
    device: str = "auto"
    requests: int = 48
    adapters: list[int] = field(default_factory=lambda: [0, 4])
    input_range: tuple[int, int] = (8, 64)
    output_range: tuple[int, int] = (8, 64)
    seed: int = 0
    rank: int = 16
    distinct_adapters: int = 8
    max_num_seqs: int = 32
    max_loras: int = 8
    max_cpu_loras: int | None = None
    targets: list[str] = field(default_factory=lambda: ["engine", "server_stream", "server_nostream", "vllm"])
    parts: list[str] = field(default_factory=lambda: ["offline", "sweep"])
    sweep_adapters: int | None = None  # None: 100 if measured offline, else the largest count
    sweep_fractions: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 1.0, 1.2)
    sweep_duration_s: float = 4.0
    sweep_warmup_s: float = 1.0
    sweep_drain_s: float = 6.0
    sweep_target: str = "server_stream"  # the server target the sweep drives (the engine's sweep runs beside it)
    soak_s: float | None = None
    soak_target: str = "server_stream"
    soak_fraction: float = 0.9
    soak_interval_s: float = 2.0
    client_processes: int = 2
    client_streams: int = 2
    vllm_max_loras: list[int] = field(default_factory=lambda: [8, 32, 256])
    vllm_adapters: list[int] | None = None  # the adapter counts vLLM runs at, of ``adapters``; None: all of them
    vllm_python: str | None = None
    vllm_gpu_memory_utilization: float = 0.85
    offline_cap_s: float = 120.0
    budget_s: float = 3600.0
    keep_output_ids: bool = False
    pack: bool | None = None  # runs/ and logs/ as one runs_and_logs.tar.gz in the output; None: when it is $OUT
    workdir: str | None = None
    fresh: bool = False
    server_start_timeout_s: float = 900.0
    merge: list[str] | None = None  # --merge: summarize these stores, measure nothing
    engine_extra: dict[str, str] = field(default_factory=dict)  # --engine-param KEY=VALUE: more EngineConfig knobs

    def __post_init__(self) -> None:
        unknown = sorted(set(self.targets) - set(TARGETS)) + sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ValueError(f"unknown targets/parts {unknown}; targets: {TARGETS}, parts: {PARTS}")
        for option, target in (("--sweep-target", self.sweep_target), ("--soak-target", self.soak_target)):
            if target not in LOAD_TARGETS:
                raise ValueError(f"{option} must be one of {', '.join(LOAD_TARGETS)}, got {target!r}")
        if "soak" in self.parts and not self.soak_s:
            raise ValueError("the soak part needs --soak SECONDS")
        if self.soak_s and "soak" not in self.parts:
            self.parts = [*self.parts, "soak"]
        if not self.adapters or min(self.adapters) < 0:
            raise ValueError(f"--adapters must be counts >= 0, got {self.adapters}")
        if self.vllm_adapters is not None and not set(self.vllm_adapters) <= set(self.adapters):
            raise ValueError(f"--vllm-adapters {self.vllm_adapters} must be among --adapters {self.adapters}: vLLM "
                             "is rated against the engine run of its own call")
        if self.sweep_adapters is None:
            self.sweep_adapters = 100 if 100 in self.adapters else max(self.adapters)

    @property
    def vllm_adapter_counts(self) -> list[int]:
        """The adapter counts each vLLM ``max_loras`` runs at in this call."""
        return list(self.adapters if self.vllm_adapters is None else self.vllm_adapters)

    @property
    def request_set(self) -> RequestSetConfig:
        return RequestSetConfig(self.requests, tuple(self.input_range), tuple(self.output_range),
                                (4, SHAPES[self.shape].vocab), self.seed)

    @property
    def engine_params(self) -> dict:
        """EngineConfig fields of both the in-process engine and the server's generator."""
        params = {"max_lora_rank": max(16, self.rank), "max_num_seqs": self.max_num_seqs, "max_loras": self.max_loras,
                  "max_model_len": self.request_set.max_model_len}
        if self.max_cpu_loras is not None:
            params["max_cpu_loras"] = self.max_cpu_loras
        return {**params, **self.engine_extra}


DEFAULTS: dict[str, dict] = {
    # S-LoRA's workload on the H200; each call (one target, one part) fits in 10 minutes with the budget's margin
    "llama3-8b": dict(
        requests=1000, adapters=[0, 5, 100, 1000], input_range=(8, 512), output_range=(8, 512), max_num_seqs=256,
        max_loras=256, max_cpu_loras=256, sweep_duration_s=45.0, sweep_warmup_s=15.0, sweep_drain_s=20.0,
        soak_interval_s=5.0, client_processes=4, client_streams=4, offline_cap_s=300.0, budget_s=500.0,
    ),
    "tiny": dict(
        requests=48, adapters=[0, 4], input_range=(8, 64), output_range=(8, 64), max_num_seqs=32, max_loras=8,
        sweep_duration_s=4.0, sweep_warmup_s=1.0, sweep_drain_s=6.0, soak_interval_s=2.0, client_processes=2,
        client_streams=2, offline_cap_s=120.0, budget_s=3600.0,
    ),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None, description: str | None = None) -> tuple[CapacityConfig, Path | None]:
    """The command line -> the call's config (the shape's DEFAULTS under what was given) and --out."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else perf/results/<date>-<gpu>/capacity)")
    p.add_argument("--requests", type=int)
    p.add_argument("--adapters", type=_ints, help="adapter counts, e.g. 0,5,100,1000 (0: base model only)")
    p.add_argument("--input-range", type=int, nargs=2)
    p.add_argument("--output-range", type=int, nargs=2)
    p.add_argument("--seed", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--distinct-adapters", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-loras", type=int)
    p.add_argument("--max-cpu-loras", type=int)
    p.add_argument("--engine-param", action="append", dest="engine_param", metavar="KEY=VALUE",
                   help="another EngineConfig knob for the engine and the server alike (repeatable), e.g. "
                        "stream_interval_ms=0")
    p.add_argument("--targets", type=_names, help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--parts", type=_names, help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--llm", action="store_true", help="also the llm ensemble (text in/out), offline")
    p.add_argument("--sweep-adapters", type=int, help="the sweep's adapter count (default 100 if listed, else the max)")
    p.add_argument("--sweep-fractions", type=_floats, help="offered rates as fractions of capacity, e.g. 0.5,0.9,1.2")
    p.add_argument("--sweep-duration", type=float, dest="sweep_duration_s", help="seconds of arrivals per point")
    p.add_argument("--sweep-warmup", type=float, dest="sweep_warmup_s", help="seconds left out of each point's window")
    p.add_argument("--sweep-drain", type=float, dest="sweep_drain_s", help="seconds a point may run after its arrivals")
    p.add_argument("--sweep-target", choices=LOAD_TARGETS,
                   help="the server target swept (default server_stream; llm: the text ensemble, listed in --targets)")
    p.add_argument("--soak", type=float, dest="soak_s", metavar="SECONDS", help="soak the server this long")
    p.add_argument("--soak-target", choices=LOAD_TARGETS,
                   help="the server target soaked (default server_stream; llm: the text ensemble and its stubs)")
    p.add_argument("--soak-fraction", type=float)
    p.add_argument("--soak-interval", type=float, dest="soak_interval_s")
    p.add_argument("--client-processes", type=int)
    p.add_argument("--client-streams", type=int, help="gRPC streams per client process")
    p.add_argument("--vllm-max-loras", type=_ints)
    p.add_argument("--vllm-adapters", type=_ints,
                   help="the adapter counts vLLM runs at, of --adapters (default: all), e.g. to leave out those where "
                        "its max_loras cannot compete")
    p.add_argument("--vllm-python", help="the interpreter with vllm (default: this one, /usr/bin/python3, python3)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float)
    p.add_argument("--offline-cap", type=float, dest="offline_cap_s", help="an offline run is cancelled after this")
    p.add_argument("--budget", type=float, dest="budget_s", help="no run starts that would end after this many s")
    p.add_argument("--keep-output-ids", action="store_true", default=None)
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="runs/ and logs/ as one runs_and_logs.tar.gz (default: when the output folder is $OUT)")
    p.add_argument("--workdir", help="checkpoints and the results store (default: $TMPDIR/manylora-capacity)")
    p.add_argument("--fresh", action="store_true", default=None, help="ignore results of earlier calls")
    p.add_argument("--server-start-timeout", type=float, dest="server_start_timeout_s")
    p.add_argument("--merge", nargs="+", type=Path, metavar="STORE",
                   help="measure nothing: one summary of these calls' store.json files (or their folders)")
    a = vars(p.parse_args(argv))
    out = Path(a.pop("out")) if a.get("out") else None
    merged = a.pop("merge")
    llm = a.pop("llm")
    extra = a.pop("engine_param") or []
    a["engine_extra"] = dict(item.split("=", 1) for item in extra) if extra else None
    values = {**DEFAULTS[a["shape"]], **{k: v for k, v in a.items() if v is not None}}
    for key in ("input_range", "output_range"):
        values[key] = tuple(values[key])
    cfg = CapacityConfig(**values)
    if llm and "llm" not in cfg.targets:
        cfg.targets = [*cfg.targets, "llm"]
    cfg.merge = [str(m) for m in merged] if merged else None
    return cfg, out

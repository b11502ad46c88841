"""perf_analyzer against a running manylora server, with inputs made from the adapters that server lists.

    python -m perf.server.perf_analyzer --url localhost:8001 --out /tmp/pa                      # the sweeps
    python -m perf.server.perf_analyzer --url localhost:8001 --out /tmp/pa --inputs-only        # inputs only
    python -m perf.server.perf_analyzer --url host:8001 --vocab-range 4 128256 --concurrency 16 --rates 2 4 8

The inputs: ``--count`` requests of S-LoRA's workload (perf/workload/trace.py: lengths uniform in the
ranges given, adapters by its power law over the adapters the server lists as ready, the first name the most
popular when alpha < 1; ``--base-fraction`` leaves some on the base model), written as perf_analyzer
``--input-data`` files: token ids for ``generator`` (``generator_input.json``), S-LoRA's "Hello " * n text for
the ``llm`` ensemble (``llm_input.json``), each entry one batch-1 request (shapes without the batch dimension,
which Triton adds), and the adapter list they were drawn from (``adapters.json``).

Then, per model, a concurrency sweep and a request-rate sweep over gRPC streaming (``--async --streaming``):
``<model>_c<N>.csv`` / ``<model>_r<R>.csv``, the profile export JSON (every response's timestamp) and the log of
each point. ``latency`` in perf_analyzer's output is that of a streamed request's first response.

perf_analyzer itself: ``--perf-analyzer BIN`` or ``perf_analyzer`` on PATH (``pip install perf-analyzer``;
its binary needs glibc >= 2.38).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from perf.workload.trace import WorkloadConfig, generate_trace

MODELS = ("generator", "llm")


def live_adapters(url: str, timeout: float = 60.0) -> list[str]:
    """The names of the adapters the server at ``url`` (gRPC) lists as ready, sorted."""
    from manylora.client import ManyLoraClient

    listed = ManyLoraClient(grpc_url=url, timeout=timeout).list_adapters()
    return sorted(a["name"] for a in listed if a.get("status", "ready") == "ready")


def entries(
    adapters: list[str],
    count: int,
    vocab_range: tuple[int, int],
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    alpha: float,
    base_fraction: float,
    seed: int,
) -> tuple[list, list]:
    """``count`` requests as perf_analyzer input entries for ``generator`` (token ids) and ``llm`` (text)."""
    trace = generate_trace(
        WorkloadConfig(
            num_adapters=max(1, len(adapters)),
            alpha=alpha,
            rate=1.0,
            duration_s=2.0 * count,  # ~2 x count arrivals at 1 req/s; the first count are kept
            input_range=input_range,
            output_range=output_range,
            base_fraction=base_fraction if adapters else 1.0,
            seed=seed,
            vocab_range=vocab_range,
        )
    )
    gen, llm = [], []
    for r in trace[:count]:
        adapter = adapters[int(r.adapter.split("-")[-1])] if (r.adapter and adapters) else ""
        common = {"max_tokens": [r.output_len], "stream": [True], "lora_name": [adapter]}
        gen.append({"input_ids": {"content": r.prompt_ids, "shape": [r.prompt_len]}, **common})
        llm.append({"text_input": [r.prompt_text().strip()], **common})
    return gen, llm


def write_inputs(out: Path, adapters: list[str], gen: list, llm: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapters.json").write_text(json.dumps(adapters) + "\n")
    (out / "generator_input.json").write_text(json.dumps({"data": gen}) + "\n")
    (out / "llm_input.json").write_text(json.dumps({"data": llm}) + "\n")


def usable(binary: str) -> bool:
    """Whether ``binary`` is perf_analyzer and runs here (its --help names --concurrency-range)."""
    try:
        done = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "concurrency-range" in done.stdout + done.stderr


def run_point(binary: str, url: str, model: str, inputs: Path, out: Path, tag: str, measure_ms: int,
              load: list[str]) -> bool:
    """One perf_analyzer run; prints the last lines of its log. False when it failed."""
    print(f"== {model} {tag}", flush=True)
    log = out / f"{model}_{tag}.log"
    command = [binary, "-m", model, "-i", "grpc", "-u", url, "--async", "--streaming", "--input-data", str(inputs),
               "--measurement-interval", str(measure_ms), "--stability-percentage", "50", "--max-trials", "3",
               "-f", str(out / f"{model}_{tag}.csv"), "--profile-export-file", str(out / f"{model}_{tag}.json"),
               *load]
    with open(log, "w") as f:
        rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"   failed: see {log}")
    for line in log.read_text(errors="replace").splitlines()[-4:]:
        print(f"   {line}")
    return rc == 0


def default_out() -> Path:
    root = Path(os.environ["OUT"]) if os.environ.get("OUT") else (
        Path(__file__).resolve().parents[1] / "results" / dt.date.today().isoformat())
    return root / "perf_analyzer"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC address")
    p.add_argument("--out", type=Path, default=None, help="default: $OUT/perf_analyzer, else perf/results/<date>/...")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64])
    p.add_argument("--rates", type=float, nargs="*", default=[1, 2, 4, 8], help="request rates (req/s)")
    p.add_argument("--measure-ms", type=int, default=10000, help="perf_analyzer's measurement interval")
    p.add_argument("--count", type=int, default=64, help="input requests")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(4, 256), help="token ids of generator's inputs")
    p.add_argument("--input-range", type=int, nargs=2, default=(8, 128))
    p.add_argument("--output-range", type=int, nargs=2, default=(8, 128))
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--base-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--perf-analyzer", default=None, help="the binary (default: perf_analyzer on PATH)")
    p.add_argument("--inputs-only", action="store_true", help="write the input files and stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = a.out or default_out()
    adapters = live_adapters(a.url)
    gen, llm = entries(adapters, a.count, tuple(a.vocab_range), tuple(a.input_range), tuple(a.output_range),
                       a.alpha, a.base_fraction, a.seed)
    inputs = out / "inputs"
    write_inputs(inputs, adapters, gen, llm)
    print(f"{len(gen)} requests over {len(adapters)} adapters of {a.url} ({', '.join(adapters[:5])}"
          f"{', ...' if len(adapters) > 5 else ''}) in {inputs}", flush=True)
    if a.inputs_only:
        return 0
    binary = a.perf_analyzer or shutil.which("perf_analyzer")
    if not binary or not usable(binary):
        print("no usable perf_analyzer: give --perf-analyzer BIN, or pip install perf-analyzer (glibc >= 2.38)",
              file=sys.stderr)
        return 2
    print(f"perf_analyzer: {binary}; server: {a.url}; results: {out}", flush=True)
    failed = 0
    for model in a.models:
        data = inputs / f"{model}_input.json"
        for c in a.concurrency:
            failed += not run_point(binary, a.url, model, data, out, f"c{c}", a.measure_ms,
                                    ["--concurrency-range", str(c)])
        for r in a.rates:
            failed += not run_point(binary, a.url, model, data, out, f"r{r:g}", a.measure_ms,
                                    ["--request-rate-range", f"{r:g}"])
    print(f"done: {out} ({failed} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

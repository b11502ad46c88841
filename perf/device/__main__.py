"""``python -m perf.device PART [ARGS]``: the measurements on a GPU machine, one part per call of under 10 minutes.

Run from the repository root with the image's python3 (torch, triton). The server parts and ``capacity`` need
``.gpu/`` copied there with the working tree (perf/device/server_env.py: the server's venv is made from it once
per machine). Each part but ``env`` and ``capacity`` writes its logs under /tmp/perf-device/PART, then
``OUT/PART.txt`` (the summary, printed last) and ``OUT/PART.tgz`` (every log); OUT is ``--out``, else ``$OUT``,
else /tmp/perf-device/out.

    python3 -m perf.device env                                   # the server's venv from .gpu/ (~1 min)
    python3 -m perf.device capacity --targets engine --parts offline  # python -m perf.capacity --shape llama3-8b ...
    python3 -m perf.device gpu-tests tests/kernels/test_engine_kernels.py -k bgmv   # compiled tests
    python3 -m perf.device kernels [--attention] [--gemm]         # LoRA kernels vs their floor; kernel table
    python3 -m perf.device decode-step --adapters 0,8,64 --attention-splits auto,1  # bench_decode_step, 3 rounds
    python3 -m perf.device profile                                # engine step phases, cProfile, eager traces
    python3 -m perf.device headline [--adapters 5 100]            # the headline workload, engine in-process
    python3 -m perf.device serve-check                            # bf16 default model served on CUDA
    python3 -m perf.device server-latency --saturation 14 [--perf-analyzer]  # TTFT/ITL at 50 / 90% of it
    python3 -m perf.device perf-analyzer --rates 2 4 6 8          # perf_analyzer sweeps against the server
    python3 -m perf.device server-probe "" "adapter_load_processes=0"  # stub threads and stacks per variant
    python3 -m perf.device openai-overhead --param max_num_seqs=256      # OpenAI front against gRPC, same requests
    python3 -m perf.device tp-smoke                               # tp=2 against tp=1 (two GPUs)

A CPU dry run of a server part: ``.venv/bin/python -m perf.device server-latency --shape tiny --device cpu
--python .venv/bin/python --saturation 4 --duration 5``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from perf.device import engine_parts
from perf.device.part import REPO, Part, grep
from perf.device.server_env import GPU_DIR, VENV, VenvError, ensure_venv, make_venv, server_environ

PASS_THROUGH = {"capacity", "gpu-tests", "decode-step", "headline"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.device", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True, metavar="PART")

    def part(name: str, text: str) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=text, description=text)
        q.add_argument("--out", type=Path, default=None, help="default: $OUT, else /tmp/perf-device/out")
        return q

    env = sub.add_parser("env", help="make the server's venv from .gpu/ (perf/device/server_env.py)")
    env.add_argument("--force", action="store_true", help="make it again even when it is complete")
    sub.add_parser("capacity", help="python -m perf.capacity --shape llama3-8b ARGS with the server's venv; "
                                    "the output also in $OUT/capacity.log", add_help=False)
    part("gpu-tests", "PYTEST_ARGS compiled on the GPU (TRITON_INTERPRET=0; default tests/kernels)")
    k = part("kernels", "LoRA kernels' compiled tests and benchmark, the kernel table")
    k.add_argument("--no-tests", action="store_true")
    k.add_argument("--attention", action="store_true", help="also the paged attention's splits")
    k.add_argument("--gemm", action="store_true", help="also the base GEMMs against cuBLAS")
    part("decode-step", "perf.engine.bench_decode_step --rounds 3 ARGS")
    part("profile", "perf.engine.profile_engine at n = 5, 2000; cProfile and eager-step traces at n = 2000")
    part("headline", "perf.engine.headline on the Llama-3-8B shape; ARGS add or override")
    t = part("tp-smoke", "tp=2 against tp=1, token for token")
    t.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    servers = []
    for name, text in (("serve-check", "the embedded default model in bf16 served on CUDA, through the client CLI"),
                       ("server-latency", "TTFT and ITL through tritonserver at fractions of a saturating rate"),
                       ("perf-analyzer", "perf_analyzer's sweeps against tritonserver on the random checkpoint"),
                       ("server-probe", "start the server per variant of engine parameters and watch its stub"),
                       ("openai-overhead", "the same requests through Triton's gRPC and through the OpenAI front")):
        s = part(name, text)
        s.add_argument("--python", default=None, help="the server's Python (default: the venv made from .gpu/)")
        s.add_argument("--device", default="cuda")
        s.add_argument("--http-port", type=int, default=8000, help="gRPC on the next port, metrics on the one after")
        servers.append(s)
    for s in servers[1:]:
        s.add_argument("--shape", default="llama3-8b")
        s.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="engine parameter")
    lat, pa, probe, front = servers[1:]
    front.add_argument("--openai-port", type=int, default=9000)
    front.add_argument("--overhead-args", default="", help="more perf.server.openai_overhead arguments, one string")
    lat.add_argument("--saturation", type=float, required=True, help="req/s, e.g. what the headline measured")
    lat.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.9])
    lat.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a fraction")
    lat.add_argument("--perf-analyzer", action="store_true", help="perf_analyzer after (--concurrency, --rates)")
    for s in (lat, pa):
        s.add_argument("--concurrency", type=int, nargs="*", default=[16])
        s.add_argument("--rates", type=float, nargs="*", default=[4.0] if s is lat else [2.0, 4.0, 6.0, 8.0])
        s.add_argument("--measure-ms", type=int, default=8000)
    probe.add_argument("variants", nargs="*", help='space-separated key=value parameters a variant ("" = defaults)')
    return p


def capacity(args: list[str]) -> int:
    """The server's venv, then the capacity benchmark on the Llama-3-8B shape with the venv's python, its output
    also in $OUT/capacity.log (/tmp/capacity_out without $OUT)."""
    try:
        python = ensure_venv()
    except VenvError as e:
        print(f"perf.device: {e}", file=sys.stderr)
        return 2
    log = Path(os.environ.get("OUT") or "/tmp/capacity_out") / "capacity.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [str(python), "-m", "perf.capacity", "--shape", "llama3-8b", *args]
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=server_environ(), cwd=REPO)
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            f.write(line)
        return proc.wait()


def _server_python(part: Part, explicit: str | None) -> tuple[str, dict[str, str]]:
    if explicit:
        return explicit, part.env
    return str(ensure_venv()), server_environ(base=part.env)


def server_part(part: Part, a: argparse.Namespace) -> None:
    from perf.device import server
    from perf.device.probe import server_probe

    server_python, env = _server_python(part, a.python)
    if a.part == "serve-check":
        server.serve_check(part, server_python, env, a.device, a.http_port)
        return
    model = server.Model.prepare(part, a.shape, a.device)
    part.stamp(f"checkpoint {a.shape} in {model.folder}", 0)
    if a.part == "server-probe":
        server_probe(part, model, server_python, env, a.variants)
        return
    front_args = ("--openai-port", str(a.openai_port)) if a.part == "openai-overhead" else ()
    srv = server.start_model_server(part, model, server_python, env, a.param, part.work / "server.log", a.http_port,
                                    front_args)
    try:
        if a.part == "openai-overhead" and srv.ready_s is not None:
            server.openai_overhead_run(part, srv, server_python, env, a.openai_port, a.overhead_args.split())
            part.add("openai overhead", grep(part.work / "openai_overhead.txt", r".", tail=8))
        if a.part == "server-latency" and srv.ready_s is not None:
            server.latency_runs(part, model, srv, server_python, env, a.saturation, a.fractions, a.duration,
                                part.work / "server")
        if (a.part == "perf-analyzer" or getattr(a, "perf_analyzer", False)) and srv.ready_s is not None:
            server.perf_analyzer_run(part, model, srv, server_python, env, a.concurrency, a.rates, a.measure_ms,
                                     part.work / "perf_analyzer")
        if server.signal_stubs(srv.session):  # every thread's stack of the stub into server.log (faulthandler)
            time.sleep(2)
    finally:
        srv.stop()
    rows: list[str] = []  # each runner prints its table (header, rule, row) last
    for log in sorted(part.work.glob("runner_*.txt")):
        rows += [line for line in grep(log, r"^\|", cut=400).splitlines() if line not in rows]
    if rows:
        part.add("server latency", "\n".join(rows))
    if (part.work / "perf_analyzer.txt").is_file():
        part.add("perf_analyzer", grep(part.work / "perf_analyzer.txt",
                                       r"^== |Throughput|latency|failed|Request Rate|Concurrency|requests over",
                                       head=60))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a, extra = _parser().parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    if extra and a.part not in PASS_THROUGH:
        print(f"perf.device {a.part}: unknown arguments {extra}", file=sys.stderr)
        return 2
    if a.part == "env":
        try:
            if a.force:
                make_venv(GPU_DIR, VENV)
            print(ensure_venv())
        except VenvError as e:
            print(f"perf.device: {e}", file=sys.stderr)
            return 2
        return 0
    if a.part == "capacity":
        return capacity(extra)
    if a.part != "tp-smoke":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    part = Part(a.part, a.out)
    part.gpu_info()
    try:
        if a.part == "gpu-tests":
            engine_parts.gpu_tests(part, extra)
        elif a.part == "kernels":
            engine_parts.kernels(part, not a.no_tests, a.attention, a.gemm)
        elif a.part == "decode-step":
            engine_parts.decode_step(part, extra)
        elif a.part == "profile":
            engine_parts.profile(part)
        elif a.part == "headline":
            engine_parts.headline(part, extra)
        elif a.part == "tp-smoke":
            engine_parts.tp_smoke(part, a.device)
        else:
            server_part(part, a)
    except VenvError as e:
        part.add("stopped", str(e))
    print(part.finish(remove=("work",)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

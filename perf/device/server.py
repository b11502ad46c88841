"""The server parts of ``python -m perf.device``: tritonserver on the GPU machine, started from the server's venv
(perf/device/server_env.py) with scripts/serve.py on a random-weight checkpoint (perf/device/checkpoint.py).

- ``server-latency``: TTFT and ITL over gRPC streaming (the ``generator`` model, S-LoRA's workload over 100
  adapters) at fractions of a saturating rate, optionally perf_analyzer after;
- ``perf-analyzer``: perf_analyzer's sweeps against that server (perf/server/perf_analyzer.py: its inputs come
  from the server's adapter list);
- ``serve-check``: the embedded default model in bf16 served on CUDA, driven with the client CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from perf.device.part import REPO, WORK_ROOT, Part, grep, stop_group

STUB = r"triton_python_backend_stub.*generator"


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def pids_matching(pattern: str, session: int) -> list[int]:
    """Processes of ``session`` (a server's: it starts one) whose command line matches ``pattern``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == session and re.search(pattern, cmdline):
            found.append(int(entry.name))
    return found


def signal_stubs(session: int, sig: int = signal.SIGUSR1) -> bool:
    """Send ``sig`` to the generator's stubs of a server's ``session`` (SIGUSR1: faulthandler writes every
    thread's stack to the server log); True when there was one."""
    pids = pids_matching(STUB, session)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return bool(pids)


@dataclass
class Model:
    """A random-weight checkpoint and what the workload needs for its shape."""

    folder: Path
    shape: str
    device: str
    vocab: int
    max_model_len: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    adapters: int

    @classmethod
    def prepare(cls, part: Part, shape: str, device: str, folder: Path | None = None) -> Model:
        """Write the checkpoint unless it is there (a child process of the image's python3)."""
        folder = folder or Path(f"/tmp/ckpt_{shape}")
        done = subprocess.run([part.python, "-m", "perf.device.checkpoint", shape, str(folder), device],
                              capture_output=True, text=True, env=part.env, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"the checkpoint of {shape} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        info = json.loads(done.stdout.strip().splitlines()[-1])
        return cls(folder, shape, device, info["vocab"], info["max_model_len"], tuple(info["input_range"]),
                   tuple(info["output_range"]), info["adapters"])


class Server:
    """tritonserver (scripts/serve.py execs it) serving ``generator`` on a checkpoint: gRPC on http_port + 1,
    metrics on http_port + 2, its log in a file."""

    def __init__(self, python: str, env: dict[str, str], log: Path, http_port: int = 8000):
        self.python, self.env, self.log, self.http_port = python, env, log, http_port
        self.grpc_url = f"127.0.0.1:{http_port + 1}"
        self.process: subprocess.Popen | None = None
        self.session = 0  # the server's session id (its pid): the stubs are in it
        self.ready_s: float | None = None

    def start(self, base: Path, catalogue: Path, params: list[str], extra_args: tuple[str, ...] = ()) -> None:
        command = [self.python, "scripts/serve.py", "--base-model", str(base), "--adapters", str(catalogue),
                   *extra_args]
        for param in params:
            command += ["--param", param]
        command += ["--http-port", str(self.http_port), "--grpc-port", str(self.http_port + 1),
                    "--metrics-port", str(self.http_port + 2), "--out", str(self.log.parent / "model_repository")]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            self.process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                            start_new_session=True)
        self.session = self.process.pid

    def wait_ready(self, limit_s: float, model: str = "generator") -> bool:
        """Until ``model`` is ready (or ``limit_s``, or the server ended); ready_s is the seconds it took."""
        t0 = time.monotonic()
        url = f"http://127.0.0.1:{self.http_port}/v2/models/{model}/ready"
        while time.monotonic() - t0 < limit_s and self.process and self.process.poll() is None:
            if ready(url):
                self.ready_s = time.monotonic() - t0
                return True
            time.sleep(1)
        return False

    def stop(self) -> None:
        """SIGTERM to the server's group, then SIGKILL to whatever of its session is left."""
        if self.process is not None:
            stop_group(self.process, grace_s=30)
            self.process = None
        for pid in pids_matching(".", self.session) if self.session else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start_model_server(part: Part, model: Model, server_python: str, server_env: dict[str, str],
                       params: list[str], log: Path, http_port: int = 8000,
                       extra_args: tuple[str, ...] = ()) -> Server:
    """The generator on ``model`` with max_num_seqs 64, max_loras 64 and the shape's max_model_len, then
    ``params`` (key=value, later ones win; ``extra_args`` for scripts/serve.py); waits up to 300 s for it."""
    server = Server(server_python, server_env, log, http_port)
    server.start(model.folder / "base", model.folder / "adapters" / "catalogue.json",
                 [f"device={model.device}", "max_num_seqs=64", "max_loras=64",
                  f"max_model_len={model.max_model_len}", *params], extra_args)
    ok = server.wait_ready(min(300.0, part.left()))
    part.stamp(f"server ready after {server.ready_s:.0f} s" if ok else "server not ready", 0 if ok else 1)
    return server


def latency_runs(part: Part, model: Model, server: Server, server_python: str, server_env: dict[str, str],
                 saturation: float, fractions: list[float], duration_s: float, out: Path) -> None:
    """At each fraction of ``saturation`` (req/s): S-LoRA's workload (alpha 1, cv 1, the shape's lengths, 100
    adapters) for ``duration_s``, replayed over gRPC streaming; summaries under ``out``."""
    for frac in fractions:
        trace = out / f"trace_{frac}.jsonl"
        part.python_step(f"trace at {frac} of {saturation} req/s", "perf.workload.trace",
                         ["--adapters", str(model.adapters), "--alpha", "1", "--rate", str(round(saturation * frac, 2)),
                          "--cv", "1", "--duration", str(duration_s), "--input-range", *map(str, model.input_range),
                          "--output-range", *map(str, model.output_range), "--vocab-range", "4", str(model.vocab),
                          "--out", str(trace)], f"trace_{frac}.txt", 60)
        part.step(f"server at {frac} of saturation",
                  [server_python, "-m", "perf.workload.runner", "--trace", str(trace), "--url", server.grpc_url,
                   "--model", "generator", "--name", f"server_{frac}_of_saturation",
                   "--max-duration", str(int(duration_s * 3)), "--no-progress", "--out", str(out)],
                  f"runner_{frac}.txt", env=server_env)


def find_perf_analyzer(env: dict[str, str], gpu_dir: Path = REPO / ".gpu", unpack_to: Path = Path("/tmp/pa")) -> str:
    """perf_analyzer: $PA_BIN, the one on the server venv's PATH (installed from .gpu/pa's wheel), or the binary
    inside that wheel unpacked to ``unpack_to``; empty when there is none."""
    if env.get("PA_BIN"):
        return env["PA_BIN"]
    from perf.server.perf_analyzer import usable

    for folder in env.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / "perf_analyzer"
        if candidate.is_file() and usable(str(candidate)):
            return str(candidate)
    for wheel in sorted((gpu_dir / "pa").glob("perf_analyzer-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpack_to)
        for binary in unpack_to.rglob("perf_analyzer"):
            if binary.is_file() and binary.parent.name == "bin":
                binary.chmod(0o755)
                return str(binary)
    return ""


def perf_analyzer_run(part: Part, model: Model, server: Server, server_python: str, server_env: dict[str, str],
                      concurrency: list[int], rates: list[float], measure_ms: int, out: Path) -> None:
    """perf_analyzer against ``server`` (perf/server/perf_analyzer.py; inputs from the server's adapter list)."""
    binary = find_perf_analyzer(server_env)
    args = ["--url", server.grpc_url, "--out", str(out), "--vocab-range", "4", str(model.vocab),
            "--concurrency", *map(str, concurrency), "--rates", *map(str, rates), "--measure-ms", str(measure_ms)]
    if binary:
        args += ["--perf-analyzer", binary]
    part.step("perf_analyzer", [server_python, "-m", "perf.server.perf_analyzer", *args], "perf_analyzer.txt",
              env=server_env)


def serve_check(part: Part, server_python: str, server_env: dict[str, str], device: str = "cuda",
                http_port: int = 8000) -> None:
    """The embedded default model, converted to bf16, served on ``device`` (CUDA) by the real tritonserver and driven
    with the client CLI: the adapter list, each adapter streamed over gRPC, /generate over HTTP, a bad request refused
    alone. The build and the conversion use the image's python3 (numpy 2 for its transformers), the server and
    the client the venv."""
    models = WORK_ROOT / "serve-check-models"  # beside the part's folder, out of its archive
    if part.python_step("build the embedded default", "manylora.embedded.build", ["--out", str(models / "default")],
                        "build.log", 300) != 0:
        part.add("build failed", grep(part.work / "build.log", ".", tail=20))
        return
    part.python_step("convert to bf16", "perf.device.bf16", [str(models / "default" / "base"), str(models / "bf16")],
                     "convert.txt", 120)
    server = Server(server_python, server_env, part.work / "server.log", http_port)
    server.start(models / "bf16", models / "default" / "catalogue.json", [f"device={device}"])
    transcript = []
    try:
        ok = server.wait_ready(min(120.0, part.left()), model="llm")
        transcript.append(f"== ready after {server.ready_s:.0f}s" if ok else "== not ready")

        def client(*args: str) -> str:
            urls = ["--url", server.grpc_url, "--http-url", f"127.0.0.1:{server.http_port}"]
            done = subprocess.run([server_python, "-m", "manylora.client", *urls, *args], capture_output=True,
                                  text=True, env=server_env, cwd=REPO, timeout=max(10.0, part.left()))
            return (done.stdout + done.stderr).rstrip()

        transcript.append(client("adapters", "list"))
        stats = client("stats")
        keys = ("device", "dtype", "kernels", "pool_pages_total", "adapters_resident")
        transcript.append("\n".join(line for line in stats.replace(",", "\n").splitlines()
                                    if any(f'"{k}"' in line for k in keys)) or stats)
        for adapter in ("", "shout", "pirate", "whisper", "numbers"):
            transcript.append(f"== adapter '{adapter or 'base'}' (streamed over gRPC)")
            transcript.append(client("generate", *(["--adapter", adapter] if adapter else []), "--max-tokens", "24",
                                     "Every Saturday there is a market"))
        transcript.append("== /generate (HTTP, one response)")
        body = json.dumps({"text_input": "Every Saturday there is a market", "max_tokens": 24, "lora_name": "shout"})
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v2/models/llm/generate",
                                         data=body.encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                transcript.append(reply.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError) as e:
            transcript.append(f"failed: {e}")
        transcript.append("== a bad request is refused alone")
        refused = client("generate", "--adapter", "no-such-adapter", "hello")
        transcript.append(refused.splitlines()[-1] if refused else "")
        transcript.append("server ready" if ready(f"http://127.0.0.1:{server.http_port}/v2/health/ready")
                          else "server not ready after the bad request")
    finally:
        server.stop()
    errors = grep(part.work / "server.log", r"(?i)error|exception", head=20)
    transcript.append("== errors in the server log (but the bad request's)")
    transcript.append("\n".join(line for line in errors.splitlines() if "no-such-adapter" not in line)[:2000])
    (part.work / "serve_check.txt").write_text("\n".join(transcript) + "\n")
    part.add("serve check", "\n".join(transcript))


def openai_overhead_run(part: Part, server: Server, server_python: str, server_env: dict[str, str], openai_port: int,
                        args: list[str]) -> None:
    """perf.server.openai_overhead against ``server`` and its OpenAI front on ``openai_port``: the same requests,
    all at once, through Triton's gRPC and through the front (``args`` add to or override its defaults)."""
    front = f"http://127.0.0.1:{openai_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ready(f"{front}/v1/models"):
        time.sleep(1)
    command = [server_python, "-m", "perf.server.openai_overhead", "--grpc", server.grpc_url, "--openai", front,
               "--requests", "1000", "--prompt-words", "256", "--max-tokens", "256", "--processes", "8",
               "--json", str(part.work / "openai_overhead.json"), *args]
    part.step("openai overhead", command, "openai_overhead.txt", env=server_env)

"""The real tritonserver for the capacity benchmark, started the way scripts/serve.py and tests/e2e start it.

scripts/serve.py is loaded from its file (it is a script, not a package module), as
tests/e2e/conftest.py does: render_repository fills in the checkpoint, the catalogue and the engine
parameters, install_stub puts this Python's backend stub in place, server_command and server_env
give the command line and its environment. The server listens on free ports of 127.0.0.1; its log
goes to a file of the output folder.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from manylora.deploy.shm_regions import remove_server_regions

REPO = Path(__file__).resolve().parents[2]


def load_serve_module():
    """scripts/serve.py as a module."""
    spec = importlib.util.spec_from_file_location("manylora_serve", REPO / "scripts" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _get(url: str, timeout: float = 2.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.read() if reply.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def http_get(url: str, timeout: float = 5.0) -> str | None:
    """The body of a GET (200 only), or None."""
    raw = _get(url, timeout)
    return None if raw is None else raw.decode("utf-8", "replace")


@dataclass
class ServerConfig:
    """One server: the checkpoint, the catalogue, generator parameters (strings, as config.pbtxt takes them).

    Attributes:
        base_dir: the checkpoint directory.
        catalogue: the catalogue JSON.
        params: generator parameters (scripts/serve.py ENGINE_PARAMS / EngineConfig fields).
        work_dir: the rendered repository goes here.
        log: the server's stdout and stderr.
        start_timeout_s: the llm ensemble must be ready by then.
    """

    base_dir: Path
    catalogue: Path
    params: dict[str, str]
    work_dir: Path
    log: Path
    start_timeout_s: float = 900.0
    env: dict[str, str] = field(default_factory=dict)


class TritonServer:
    """A tritonserver process on free ports; :meth:`start` returns once /v2/health/ready and llm are ready."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.process: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.ready_s: float | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> TritonServer:
        serve = load_serve_module()
        cfg = self.config
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        cfg.log.parent.mkdir(parents=True, exist_ok=True)
        repository = serve.render_repository(cfg.base_dir, cfg.catalogue, cfg.work_dir / "model_repository", cfg.params)
        serve.install_stub()
        self.http_port, self.grpc_port, self.metrics_port = serve.free_ports(3)
        command = serve.server_command(repository, self.http_port, self.grpc_port, self.metrics_port)
        env = {k: v for k, v in os.environ.items() if k != "MANYLORA_ALLOW_RUNTIME_ADAPTERS"}
        t0 = time.monotonic()
        with open(cfg.log, "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=serve.server_env({**env, **cfg.env}),
                cwd=cfg.work_dir,
            )
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - t0 > self.config.start_timeout_s:
                raise RuntimeError(f"tritonserver not ready after {self.config.start_timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def ready(self) -> bool:
        return (_get(f"{self.http_url}/v2/health/ready") is not None
                and _get(f"{self.http_url}/v2/models/llm/ready") is not None)

    def stop(self, timeout: float = 60.0) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        remove_server_regions(list(process.args))  # those a killed server left
        return process.returncode

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.config.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

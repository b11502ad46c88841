"""The real Triton server on the embedded default model, started once per test session.

The model is build/default when `make default-model` made it; otherwise it is built with
fewer training steps (the tests compare the server with transformers+peft on the same
checkpoint, so quality matters little) into build/e2e, where later runs reuse it.
MANYLORA_E2E_MODEL=<dir with base/ and catalogue.json> serves another build instead.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from manylora.deploy.shm_regions import prefix_of, regions_of, remove_regions

REPO = Path(__file__).resolve().parents[2]
E2E_BUILD = REPO / "build" / "e2e"
DEFAULT_BUILD = REPO / "build" / "default"
E2E_STEPS, E2E_ADAPTER_STEPS = 300, 15
START_TIMEOUT_S = 180
EXIT_TIMEOUT_S = 10  # tritonserver --exit-timeout-secs: the longest a stop waits for requests and models
# a short context, so that "prompt longer than the context" needs no huge prompt
MAX_MODEL_LEN = 256


def _load_serve():
    spec = importlib.util.spec_from_file_location("manylora_serve", REPO / "scripts" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve = _load_serve()


@dataclass
class Server:
    http_url: str  # host:port
    grpc_url: str
    http_port: int
    grpc_port: int
    base_model: Path
    catalogue: dict[str, str]
    log: Path
    process: subprocess.Popen
    metrics_port: int = 0
    max_model_len: int = MAX_MODEL_LEN
    admin_key: str = ""  # the value of serve.ADMIN_HEADER that opens the restricted APIs
    shm_prefix: str = ""  # the names of its Python backend's shared-memory regions start so

    def shm_regions(self) -> list[Path]:
        """This server's Python-backend regions in /dev/shm."""
        return regions_of(self.shm_prefix)

    def client(self):
        from manylora.client import ManyLoraClient

        return ManyLoraClient(grpc_url=self.grpc_url, http_url=self.http_url, timeout=120)

    def ready(self) -> bool:
        return _get(f"http://{self.http_url}/v2/health/ready") and _get(f"http://{self.http_url}/v2/models/llm/ready")

    def model_ready(self, model: str) -> bool:
        return _get(f"http://{self.http_url}/v2/models/{model}/ready")

    def live(self) -> bool:
        return _get(f"http://{self.http_url}/v2/health/ready")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode("utf-8")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None:
                pytest.fail(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"tritonserver not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int | None:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        process = self.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=EXIT_TIMEOUT_S + 15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.shm_prefix:
            remove_regions(self.shm_prefix)  # those a killed server (or a killed stub) left
        if process.returncode not in (0, -15):
            print(f"tritonserver exited with {process.returncode}:\n{self.log_tail(40)}", file=sys.stderr)

    def post(self, path: str, body: dict) -> tuple[int, str]:
        """POST a JSON body to the HTTP endpoint; (status, body text), errors included."""
        request = urllib.request.Request(
            f"http://{self.http_url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, reply.read().decode("utf-8")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8")

    def log_tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def embedded_model() -> Path:
    given = os.environ.get("MANYLORA_E2E_MODEL")
    if given:
        return Path(given).resolve()
    from manylora.embedded.build import BuildParams, build_default, is_complete

    if is_complete(DEFAULT_BUILD, BuildParams()):  # `make default-model` was run: use that one
        return DEFAULT_BUILD
    E2E_BUILD.parent.mkdir(parents=True, exist_ok=True)
    with open(E2E_BUILD.parent / "e2e.lock", "w") as lock:  # parallel test workers build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_default(E2E_BUILD, steps=E2E_STEPS, adapter_steps=E2E_ADAPTER_STEPS, summary=False)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return embedded_model()


RUNTIME_ENV = "MANYLORA_ALLOW_RUNTIME_ADAPTERS"


def start_server(
    model_dir: Path,
    work: Path,
    params: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    catalogue_file: Path | None = None,
    wait: bool = True,
    open_apis: tuple[str, ...] = (),
) -> Server:
    """Render the repository into ``work`` and start tritonserver on free ports (127.0.0.1), with the
    administrative APIs restricted as scripts/serve.py does (less ``open_apis``) under a fresh admin key.

    The server's environment is this process's without MANYLORA_ALLOW_RUNTIME_ADAPTERS, plus
    ``env``. With ``wait`` it returns once the llm ensemble is ready (or fails the test).
    """
    catalogue_file = catalogue_file or model_dir / "catalogue.json"
    params = {"max_model_len": str(MAX_MODEL_LEN), **(params or {})}
    repository = serve.render_repository(model_dir / "base", catalogue_file, work / "model_repository", params)
    serve.install_stub()
    http_port, grpc_port, metrics_port = serve.free_ports(3)
    key = secrets.token_urlsafe(16)
    command = serve.server_command(repository, http_port, grpc_port, metrics_port,
                                   restrictions=serve.restriction_flags(key, open_apis))
    # a stop that stalls in the generator stub's unload (docs/operations.md, "Stopping") costs 10 s, not 30
    command.append(f"--exit-timeout-secs={EXIT_TIMEOUT_S}")
    base_env = {k: v for k, v in os.environ.items() if k != RUNTIME_ENV}
    log = work / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=serve.server_env({**base_env, **(env or {})}), cwd=work
        )
    srv = Server(
        http_url=f"127.0.0.1:{http_port}",
        grpc_url=f"127.0.0.1:{grpc_port}",
        http_port=http_port,
        grpc_port=grpc_port,
        base_model=model_dir / "base",
        catalogue=json.loads(catalogue_file.read_text()),
        log=log,
        process=process,
        metrics_port=metrics_port,
        max_model_len=int(params["max_model_len"]),
        admin_key=key,
        shm_prefix=prefix_of(command),
    )
    if wait:
        try:
            srv.wait_ready()
        except BaseException:
            srv.stop()
            raise
    return srv


@pytest.fixture(scope="session")
def make_server():
    """start_server, for tests that need a server of their own (they stop it)."""
    return start_server


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The server as an operator starts it by default: runtime adapter updates off."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("triton"))
    try:
        yield srv
    finally:
        srv.stop()


# the admin server: runtime adapter updates on, a short queue (2 running + 4 waiting at most)
ADMIN_PARAMS = {"max_queue_size": "4", "max_num_seqs": "2", "metrics_adapter_labels": "3"}


@pytest.fixture(scope="session")
def admin_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second server (started on first use) with MANYLORA_ALLOW_RUNTIME_ADAPTERS=1 and
    max_queue_size 4, for adapter load/unload, queue-overflow and metrics tests."""
    srv = start_server(model_dir, tmp_path_factory.mktemp("triton-admin"), ADMIN_PARAMS, {RUNTIME_ENV: "1"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server: Server):
    return server.client()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from manylora.engine.requests.detokenize import load_tokenizer

    return load_tokenizer(model_dir / "base")


@pytest.fixture(scope="session")
def openai_front(server: Server, tmp_path_factory: pytest.TempPathFactory):
    """The OpenAI-compatible front (python -m manylora.openai, tests/e2e/openai_front.py) against ``server``, one
    process per session; its adapter management is on (the server itself refuses runtime updates)."""
    from openai_front import start_front

    front = start_front(server.grpc_url, tmp_path_factory.mktemp("openai-front"), "--stats-interval", "0")
    try:
        yield front
    finally:
        front.stop()

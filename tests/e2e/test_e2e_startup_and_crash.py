"""Servers of their own: a pinned sha256 that does not match refuses to start (naming the
adapter), a dead generator stub is caught by scripts/healthcheck.py while Triton 2.51's
/v2/health/ready still says ready, and a tritonserver that dies with requests in flight takes the
generator's stub and engine process with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import EXIT_TIMEOUT_S
from processes import process_alive

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HEALTHCHECK = REPO / "scripts" / "healthcheck.py"


def healthcheck(server, timeout: float = 10.0) -> subprocess.CompletedProcess:
    command = [sys.executable, str(HEALTHCHECK), "--url", server.grpc_url, "--timeout", str(timeout)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)


def test_pinned_sha256_mismatch_refuses_to_start_when_strict(model_dir, tmp_path, make_server):
    """With strict_adapters the server fails fast on a pinned sha256 that does not match (by default that adapter
    alone is refused: tests/e2e/test_e2e_bad_adapter.py)."""
    catalogue = json.loads((model_dir / "catalogue.json").read_text())
    pinned = {name: path for name, path in catalogue.items()}
    pinned["shout"] = {"path": catalogue["shout"], "sha256": "0" * 64}
    catalogue_file = tmp_path / "pinned.json"
    catalogue_file.write_text(json.dumps(pinned))
    srv = make_server(model_dir, tmp_path, {"strict_adapters": "true"}, catalogue_file=catalogue_file, wait=False)
    try:
        # the engine process logs its traceback first; the generator's one line with the reason follows (seconds
        # later on a loaded machine)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and srv.process.poll() is None:
            if "generator: engine failed to start" in srv.log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        log = srv.log.read_text(errors="replace")
        assert "generator: engine failed to start" in log, srv.log_tail()
        lines = [line for line in log.splitlines() if "generator: engine failed to start" in line]
        assert any("'shout'" in line and "sha256" in line for line in lines), lines
        assert not srv.model_ready("generator")
        srv.wait_exit(60)  # tritonserver (--exit-on-error, the default) exits: not all models loaded
        print("startup refusal:", lines[0][:300], "| exit code", srv.process.returncode)
        assert srv.process.returncode not in (None, 0), srv.log_tail()
    finally:
        srv.stop()


def _ps() -> list[tuple[int, int, str]]:
    """(pid, ppid, command line) of every process; -ww: pytest sets COLUMNS, which ps obeys and truncates."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.strip().split(None, 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            rows.append((int(parts[0]), int(parts[1]), parts[2]))
    return rows


def _stubs(server_pid: int, model: str) -> list[int]:
    """Pids of the server's triton_python_backend_stub children that run ``model``."""
    return [pid for pid, ppid, args in _ps()
            if ppid == server_pid and "triton_python_backend_stub" in args and f"/{model}/1/model.py" in args]


@pytest.mark.parametrize("model", ["generator", "postprocessing"])
def test_dead_stub_is_caught_by_the_healthcheck(model, model_dir, tmp_path, make_server):
    """A dead stub of the generator (every request fails) or of postprocessing (llm requests wait forever: a
    decoupled model's stub is not restarted) fails the check while Triton 2.51 still reports itself ready."""
    srv = make_server(model_dir, tmp_path)
    try:
        ok = healthcheck(srv)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("ok:") and "'generator'" in ok.stdout and "'llm'" in ok.stdout, ok.stdout
        stubs = _stubs(srv.process.pid, model)
        assert stubs, (srv.process.pid, [r for r in _ps() if "stub" in r[2]])
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)  # the stubs this test's server started
        time.sleep(2)
        assert srv.process.poll() is None, f"tritonserver died with the {model} stub"
        ready = srv.live() and srv.model_ready(model) and srv.model_ready("llm")
        dead = healthcheck(srv, timeout=10)
        print(f"after killing {model}: /v2/health/ready and the models ready = {ready}; healthcheck "
              f"rc={dead.returncode}: {dead.stderr.strip()[:300]}")
        assert ready, "Triton 2.51 now reports the dead stub (readiness tied to stub health?)"
        assert dead.returncode != 0 and dead.stderr.startswith("unhealthy:"), (dead.returncode, dead.stderr)
        assert ("'generator'" if model == "generator" else "'llm'") in dead.stderr, dead.stderr
    finally:
        srv.stop()


def _children(pid: int) -> list[int]:
    return [child for child, ppid, _ in _ps() if ppid == pid]


def test_a_killed_server_takes_the_generator_stub_and_engine_with_it(model_dir, tmp_path, make_server):
    """Stopped with streams in flight, tritonserver 2.51 waits its exit timeout, says "Exiting immediately" and
    then hangs (the stub's sends, cancellation checks and metric updates wait on it, and it on them) until it is
    killed, as a stop (here, Kubernetes) does after its grace period. Its generator stub must not outlive it: it
    would wait on its sends forever, and its engine process compute on (and hold the GPU)."""
    srv = make_server(model_dir, tmp_path, {"max_model_len": "4096"})
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        assert srv.shm_regions(), f"the server's stubs have no region named {srv.shm_prefix}* (the flag unread?)"
        [stub] = _stubs(srv.process.pid, "generator")
        engines = _children(stub)
        assert engines, f"no engine process under the generator stub {stub}"
        inputs = []
        for name, array, dtype in [("input_ids", np.array([[0, 40, 41, 42]], np.int32), "INT32"),
                                   ("max_tokens", np.array([[3000]], np.int32), "INT32"),
                                   ("stream", np.array([[True]]), "BOOL"), ("ignore_eos", np.array([[True]]), "BOOL")]:
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.start_stream(callback=lambda result, error: None)
        for _ in range(3):
            client.async_stream_infer("generator", inputs)
        deadline = time.monotonic() + 20
        while srv.client().stats()["running"] < 3:
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.05)
        srv.process.terminate()
        try:
            srv.process.wait(EXIT_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            print("tritonserver hung after its exit timeout; killed")
            srv.process.kill()
            srv.process.wait(10)
        deadline = time.monotonic() + 15
        while any(process_alive(pid) for pid in [stub, *engines]) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in [stub, *engines] if process_alive(pid)]
        assert not left, f"still running after the server was killed: {[r for r in _ps() if r[0] in left]}"
    finally:
        client.stop_stream(cancel_requests=True)
        srv.stop()
    assert not srv.shm_regions(), "the regions of the killed server are still in /dev/shm after its stop"

"""scripts/serve.py --openai-port (what `make serve` runs): tritonserver and the OpenAI-compatible front start side by
side, the front answers through the server, and stopping serve.py stops both."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import MAX_MODEL_LEN, serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except OSError:
        return 0, b""


def test_serve_starts_and_stops_the_front_with_the_server(model_dir, tmp_path):
    http_port, grpc_port, metrics_port, openai_port = serve.free_ports(4)
    command = [sys.executable, str(REPO / "scripts" / "serve.py"), "--base-model", str(model_dir / "base"),
               "--adapters", str(model_dir / "catalogue.json"), "--out", str(tmp_path / "repository"),
               "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
               "--openai-port", str(openai_port), "--admin-key", "test-key",
               "--param", f"max_model_len={MAX_MODEL_LEN}"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    front = f"http://127.0.0.1:{openai_port}"
    try:
        deadline = time.monotonic() + 180
        while _get(f"{front}/health")[0] != 200:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        status, body = _get(f"{front}/v1/models")
        assert status == 200 and {m["id"] for m in json.loads(body)["data"]} == {"base", *json.loads(
            (model_dir / "catalogue.json").read_text())}
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children  # tritonserver and the front
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=90)
    assert code in (0, -15), log.read_text()[-3000:]
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert _get(f"{front}/health")[0] == 0

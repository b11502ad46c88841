"""Start the OpenAI-compatible front (``python -m manylora.openai``) against a test server, as scripts/serve.py does."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 60


@dataclass
class Front:
    url: str  # http://127.0.0.1:PORT
    admin_key: str
    process: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            return reply.read().decode("utf-8")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no front log)"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_front(grpc_url: str, work: Path, *extra: str) -> Front:
    """The front on a free loopback port against the server at ``grpc_url``, adapter management on under a fresh
    operator key; returns once its /health answers 200."""
    port, key = _free_port(), secrets.token_urlsafe(16)
    log = work / "openai-front.log"
    command = [sys.executable, "-m", "manylora.openai", "--triton-grpc", grpc_url, "--port", str(port),
               "--allow-adapter-management", f"--admin-key={key}", *extra]  # a key may start with "-"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ), cwd=work)
    front = Front(url=f"http://127.0.0.1:{port}", admin_key=key, process=process, log=log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _healthy(front.url):
        if process.poll() is not None or time.monotonic() > deadline:
            front.stop()
            raise RuntimeError(f"the OpenAI front did not become ready:\n{front.log_tail()}")
        time.sleep(0.2)
    return front

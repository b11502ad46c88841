"""The launcher's supervisor (manylora.deploy.supervisor) on stand-in servers: a server that stops on SIGTERM
ends with its own status, one that hangs past its exit timeout is killed with its children, and the front is
stopped with the server."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from processes import process_alive

from manylora.deploy.supervisor import StopPolicy, exit_timeout_s, supervise


def _script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def _signal_when_ready(*ready: Path, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> threading.Thread:
    """SIGTERM to this process (the supervisor's) once every ``ready`` file exists."""
    def send() -> None:
        deadline = time.monotonic() + timeout_s
        while not all(p.exists() for p in ready) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("cmd, expected", [
    (["tritonserver", "--model-repository=/r"], 30.0),
    (["tritonserver", "--exit-timeout-secs=5"], 5.0),
    (["tritonserver", "--exit-timeout-secs", "12"], 12.0),
])
def test_exit_timeout_is_read_from_the_command_line(cmd, expected):
    assert exit_timeout_s(cmd) == expected


def test_a_server_that_stops_on_sigterm_ends_with_its_own_status_and_stops_the_front(tmp_path):
    ready, front_ready = tmp_path / "ready", tmp_path / "front-ready"
    server = _script(tmp_path, "server.py", f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        pathlib.Path({str(ready)!r}).touch()
        while True:
            time.sleep(0.05)
    """)
    front = _script(tmp_path, "front.py", f"""
        import os, pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the supervisor's terminate-then-kill ends it
        pathlib.Path({str(front_ready)!r}).with_suffix(".pid").write_text(str(os.getpid()))
        pathlib.Path({str(front_ready)!r}).touch()
        while True:
            time.sleep(0.05)
    """)
    _signal_when_ready(ready, front_ready)
    started = time.monotonic()
    code = supervise(server, dict(os.environ), front, StopPolicy(exit_timeout_s=20, grace_s=20))
    assert code == 7
    assert time.monotonic() - started < 25  # not the kill: the server stopped by itself
    front_pid = int(front_ready.with_suffix(".pid").read_text())
    assert not process_alive(front_pid)


def test_a_server_that_hangs_after_sigterm_is_killed_with_its_children_after_exit_timeout_and_grace(tmp_path, capfd):
    ready, child_pid_file = tmp_path / "ready", tmp_path / "stub.pid"
    server = _script(tmp_path, "server.py", f"""
        import pathlib, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like tritonserver waiting on a stub that never finalizes
        stub = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        pathlib.Path({str(child_pid_file)!r}).write_text(str(stub.pid))
        pathlib.Path({str(ready)!r}).touch()
        while True:
            time.sleep(0.05)
    """)
    policy = StopPolicy(exit_timeout_s=0.5, grace_s=0.5)
    _signal_when_ready(ready)
    started = time.monotonic()
    code = supervise(server, dict(os.environ), None, policy)
    took = time.monotonic() - started
    assert code == -signal.SIGKILL
    assert policy.kill_after_s <= took < 20
    stub_pid = int(child_pid_file.read_text())
    deadline = time.monotonic() + 5
    while process_alive(stub_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(stub_pid), "the server's child outlived the kill"
    assert "did not stop within 1 s of the signal" in capfd.readouterr().err


def test_the_signal_handlers_are_given_back(tmp_path):
    server = _script(tmp_path, "server.py", "import sys; sys.exit(0)\n")
    before = signal.getsignal(signal.SIGTERM)
    assert supervise(server, dict(os.environ)) == 0
    assert signal.getsignal(signal.SIGTERM) is before

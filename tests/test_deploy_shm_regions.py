"""manylora.deploy.shm_regions: a server's Python-backend regions named apart and removed once it is gone; the
launcher's supervisor removes those a killed server left and no other server's."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from manylora.deploy.shm_regions import (
    SHM_DIR,
    TRITON_DEFAULT_PREFIX,
    is_own_prefix,
    new_prefix,
    prefix_flag,
    prefix_of,
    regions_of,
    remove_regions,
)
from manylora.deploy.supervisor import StopPolicy, supervise
from perf.capacity.server import load_serve_module


def test_each_server_gets_a_prefix_of_its_own_and_its_command_line_gives_it_back():
    prefixes = {new_prefix() for _ in range(200)}
    assert len(prefixes) == 200
    for prefix in prefixes:
        assert is_own_prefix(prefix)
        assert not prefix.startswith(TRITON_DEFAULT_PREFIX) and not TRITON_DEFAULT_PREFIX.startswith(prefix)
        assert prefix_of(["tritonserver", "--model-repository=/r", prefix_flag(prefix), "--exit-timeout-secs=5"]) \
            == prefix
    first, second = sorted(prefixes)[:2]
    assert prefix_of([prefix_flag(first), prefix_flag(second)]) == second  # the last flag wins, as in tritonserver
    assert prefix_of(["tritonserver", "--backend-config=python,shm-default-byte-size=4194304"]) is None


def test_only_the_regions_of_the_prefix_are_removed(tmp_path):
    mine, other = new_prefix(), new_prefix()
    made = {prefix: [tmp_path / f"{prefix}{os.urandom(8).hex()}" for _ in range(3)] for prefix in (mine, other)}
    for paths in made.values():
        for path in paths:
            path.write_bytes(os.urandom(64))
    unrelated = tmp_path / "manylora-adapter-123-abc"
    unrelated.write_bytes(b"x")
    assert regions_of(mine, tmp_path) == sorted(made[mine])
    assert sorted(remove_regions(mine, tmp_path)) == sorted(p.name for p in made[mine])
    assert not any(p.exists() for p in made[mine])
    assert all(p.exists() for p in made[other]) and unrelated.exists()
    assert remove_regions(mine, tmp_path) == []
    assert regions_of(mine, tmp_path / "missing") == []
    with pytest.raises(ValueError, match="empty prefix"):
        remove_regions("", tmp_path)


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_the_supervisor_removes_what_a_killed_server_left_and_not_a_neighbours_regions(tmp_path, capfd):
    """A stand-in server that makes regions under its prefix (as its stubs would), ignores SIGTERM and is killed
    after its exit timeout: its regions go with it; a region of another server's prefix stays."""
    prefix, neighbour = new_prefix(), new_prefix()
    ready = tmp_path / "ready"
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time, uuid
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        prefix = [a for a in sys.argv if a.startswith("--backend-config=python,shm-region-prefix-name=")][-1]
        prefix = prefix.split("=", 2)[2]
        for _ in range(3):
            pathlib.Path("/dev/shm", prefix + str(uuid.uuid4())).write_bytes(b"region")
        pathlib.Path({str(ready)!r}).touch()
        while True:
            time.sleep(0.05)
    """))
    other = SHM_DIR / f"{neighbour}{os.urandom(8).hex()}"
    other.write_bytes(b"another server's region")
    try:
        def stop_when_ready() -> None:
            deadline = time.monotonic() + 30
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=stop_when_ready, daemon=True).start()
        code = supervise([sys.executable, str(script), prefix_flag(prefix)], dict(os.environ), None,
                         StopPolicy(exit_timeout_s=0.3, grace_s=0.3))
        assert code == -signal.SIGKILL
        assert regions_of(prefix) == []
        assert other.exists()
        assert f"removed 3 shared-memory region(s) the server left in /dev/shm ({prefix}*)" in capfd.readouterr().err
    finally:
        remove_regions(prefix)
        other.unlink(missing_ok=True)


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_prefix_the_operator_passed_is_left_alone(tmp_path, capfd):
    """A prefix not of new_prefix()'s form (Triton's default, an operator's own) may be shared by other servers:
    the supervisor removes nothing under it."""
    shared = f"operator_{os.urandom(4).hex()}_"
    for prefix in (shared, TRITON_DEFAULT_PREFIX):
        assert not is_own_prefix(prefix)
    region = SHM_DIR / f"{shared}{os.urandom(8).hex()}"
    region.write_bytes(b"another server's region")
    script = tmp_path / "server.py"
    script.write_text("import sys; sys.exit(0)\n")
    try:
        assert supervise([sys.executable, str(script), prefix_flag(new_prefix()), prefix_flag(shared)],
                         dict(os.environ)) == 0
        assert region.exists()
    finally:
        region.unlink(missing_ok=True)


def test_a_server_that_leaves_nothing_is_not_reported(tmp_path, capfd):
    script = tmp_path / "server.py"
    script.write_text("import sys; sys.exit(0)\n")
    assert supervise([sys.executable, str(script), prefix_flag(new_prefix())], dict(os.environ)) == 0
    assert "shared-memory region" not in capfd.readouterr().err


def test_the_launcher_gives_every_server_its_own_prefix(monkeypatch, tmp_path):
    serve = load_serve_module()
    monkeypatch.setattr(serve, "triton_home", lambda: tmp_path)
    first, second = (serve.server_command(tmp_path / "repo") for _ in range(2))
    assert prefix_of(first) and prefix_of(second) and prefix_of(first) != prefix_of(second)
    given = new_prefix()
    assert prefix_of(serve.server_command(tmp_path / "repo", shm_prefix=given)) == given

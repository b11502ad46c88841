"""The CLI against the running server: adapters list, generate."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _cli(server, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "manylora.client", "--url", server.grpc_url, "--http-url", server.http_url, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("full", [False, True])
def test_adapters_list(server, full):
    done = _cli(server, "adapters", "list", *(["--full"] if full else []))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "RANK", "TARGET", "MODULES", "SHA256", "/", "REASON"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == set(server.catalogue)
    for name, path in server.catalogue.items():
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        sha = hashlib.sha256((Path(path) / "adapter_model.safetensors").read_bytes()).hexdigest()
        _, status, rank, targets, shown = rows[name]
        assert status == "ready"
        assert int(rank) == config["r"]
        assert set(targets.split(",")) == set(config["target_modules"])
        assert shown == (sha if full else sha[:12])


def test_generate_streams_text(server, client):
    prompt = "In the morning the baker"
    done = _cli(server, "generate", "--adapter", "shout", "--max-tokens", "20", prompt)
    assert done.returncode == 0, done.stderr
    expected = client.generate(prompt, adapter="shout", max_tokens=20)
    assert expected.strip()
    assert done.stdout == expected + "\n"
    no_stream = _cli(server, "generate", "--adapter", "shout", "--max-tokens", "20", "--no-stream", prompt)
    assert no_stream.stdout == expected + "\n"


def test_generate_error_exits_nonzero(server):
    done = _cli(server, "generate", "--adapter", "no-such-adapter", "hello")
    assert done.returncode == 1
    assert "no-such-adapter" in done.stderr


def test_stats(server):
    done = _cli(server, "stats")
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout), dict)

"""Runtime adapter management through the real server (issue "adapter lifecycle").

The default server (no MANYLORA_ALLOW_RUNTIME_ADAPTERS) refuses load/unload; the admin server
(env var set) loads, replaces and unloads adapters, and they show in `adapters list` at once.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from manylora.client import ManyLoraError

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PROMPT = "In the morning the baker"


def _sha(adapter_dir: str) -> str:
    return hashlib.sha256((Path(adapter_dir) / "adapter_model.safetensors").read_bytes()).hexdigest()


def _cli(server, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "manylora.client", "--url", server.grpc_url, "--http-url", server.http_url, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def _names(client) -> set[str]:
    return {a["name"] for a in client.list_adapters()}


def test_default_server_refuses_runtime_updates(server, client):
    for call in (lambda: client.load_adapter("x", server.catalogue["shout"]), lambda: client.unload_adapter("shout")):
        with pytest.raises(ManyLoraError) as info:
            call()
        assert "MANYLORA_ALLOW_RUNTIME_ADAPTERS" in info.value.message, info.value.message
    assert _names(client) == set(server.catalogue)
    done = _cli(server, "adapters", "load", "x", server.catalogue["shout"])
    assert done.returncode == 1 and "MANYLORA_ALLOW_RUNTIME_ADAPTERS" in done.stderr, done.stderr
    assert client.generate(PROMPT, adapter="shout", max_tokens=4)  # still serving


def test_load_replace_unload(admin_server):
    client = admin_server.client()
    shout, pirate = admin_server.catalogue["shout"], admin_server.catalogue["pirate"]
    expected_shout = client.generate(PROMPT, adapter="shout", max_tokens=12)
    expected_pirate = client.generate(PROMPT, adapter="pirate", max_tokens=12)
    assert expected_shout != expected_pirate

    info = client.load_adapter("copy", shout)
    assert info["name"] == "copy" and info["sha256"] == _sha(shout), info
    assert "copy" in _names(client)  # listed at once
    result = client.generate_result(PROMPT, adapter="copy", max_tokens=12)
    assert result.text == expected_shout and result.lora_version == _sha(shout)

    with pytest.raises(ManyLoraError) as info:  # the name is taken
        client.load_adapter("copy", pirate)
    assert "already registered" in info.value.message, info.value.message

    with pytest.raises(ManyLoraError) as info:  # pinned weights that differ
        client.load_adapter("pinned", pirate, sha256=_sha(shout))
    assert "pinned" in info.value.message and "sha256" in info.value.message, info.value.message
    assert "pinned" not in _names(client)
    assert client.load_adapter("pinned", pirate, sha256=_sha(pirate))["sha256"] == _sha(pirate)

    replaced = client.load_adapter("copy", pirate, replace=True)
    assert replaced["sha256"] == _sha(pirate)
    result = client.generate_result(PROMPT, adapter="copy", max_tokens=12)
    assert result.text == expected_pirate and result.lora_version == _sha(pirate)

    with pytest.raises(ManyLoraError) as info:
        client.load_adapter("ghost", "/nonexistent/adapter")
    assert "ghost" in info.value.message, info.value.message

    for name in ("copy", "pinned"):
        assert client.unload_adapter(name)["name"] == name
        assert name not in _names(client)
        with pytest.raises(ManyLoraError) as info:
            client.generate(PROMPT, adapter=name, max_tokens=4)
        assert name in info.value.message
    with pytest.raises(ManyLoraError) as info:
        client.unload_adapter("copy")
    assert "unknown adapter" in info.value.message, info.value.message
    assert _names(client) == set(admin_server.catalogue)
    assert admin_server.ready()


def test_cli_load_and_unload(admin_server):
    path = admin_server.catalogue["numbers"]
    done = _cli(admin_server, "adapters", "load", "cli-copy", path, "--sha256", _sha(path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sha256"] == _sha(path)
    listing = _cli(admin_server, "adapters", "list")
    assert "cli-copy" in listing.stdout
    again = _cli(admin_server, "adapters", "load", "cli-copy", path)
    assert again.returncode == 1 and "already registered" in again.stderr
    replaced = _cli(admin_server, "adapters", "load", "cli-copy", admin_server.catalogue["shout"], "--replace")
    assert replaced.returncode == 0, replaced.stderr
    done = _cli(admin_server, "adapters", "unload", "cli-copy")
    assert done.returncode == 0, done.stderr
    assert "cli-copy" not in _cli(admin_server, "adapters", "list").stdout
    missing = _cli(admin_server, "adapters", "unload", "cli-copy")
    assert missing.returncode == 1 and "unknown adapter" in missing.stderr

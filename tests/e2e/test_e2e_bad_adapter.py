"""A bad adapter in the catalogue, through the real server: by default it is refused alone (listed with its reason,
counted in a metric, requests naming it fail with the reason) and every other adapter serves exactly as on a server
without it; with strict_adapters=true the generator fails to start, and its stub exits without crashing."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from manylora.client import ManyLoraError

pytestmark = pytest.mark.e2e

PROMPTS = ["In the morning the baker", "The river runs by"]
BAD = "pickled"
REASON = "has only adapter_model.bin"
CRASH_SIGNS = ("Segmentation fault", "signal 11", "SIGSEGV", "Fatal Python error")


@pytest.fixture(scope="module")
def catalogue_file(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The build's good adapters plus one shipped as a pickle (adapter_model.bin), which the engine refuses."""
    root = tmp_path_factory.mktemp("bad-adapter")
    catalogue = json.loads((model_dir / "catalogue.json").read_text())
    pickled = root / BAD
    shutil.copytree(catalogue["shout"], pickled)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    path = root / "catalogue.json"
    path.write_text(json.dumps({**catalogue, BAD: str(pickled)}))
    return path


def _refused_gauge(server) -> float | None:
    match = re.search(r"^manylora_adapters_refused(?:\{[^}]*\})? (\S+)$", server.metrics(), re.MULTILINE)
    return float(match.group(1)) if match else None


def test_a_bad_adapter_is_refused_alone(model_dir, catalogue_file, tmp_path, make_server, server):
    good = sorted(json.loads((model_dir / "catalogue.json").read_text()))
    srv = make_server(model_dir, tmp_path, catalogue_file=catalogue_file)
    try:
        client, reference = srv.client(), server.client()
        listing = {a["name"]: a for a in client.list_adapters()}
        assert sorted(listing) == sorted([*good, BAD])
        assert all(listing[name]["status"] == "ready" for name in good), listing
        assert listing[BAD]["status"] == "refused" and REASON in listing[BAD]["reason"], listing[BAD]
        assert not any("path" in a for a in listing.values()), listing
        assert str(catalogue_file.parent) not in json.dumps(listing)  # no server path, in the reasons either

        with pytest.raises(ManyLoraError) as err:
            client.generate(PROMPTS[0], adapter=BAD, max_tokens=4)
        message = err.value.message
        assert f"adapter '{BAD}' was refused at startup" in message and REASON in message, message
        for adapter in [None, *good]:  # every other adapter serves as on a server without the bad one
            for prompt in PROMPTS:
                text = client.generate(prompt, adapter=adapter, max_tokens=12)
                assert text and text == reference.generate(prompt, adapter=adapter, max_tokens=12), (adapter, prompt)
        assert client.stats()["adapters_refused"] == 1

        deadline = time.monotonic() + 10  # the generator's stats poller sets the gauge every 0.5 s
        while _refused_gauge(srv) != 1.0 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert _refused_gauge(srv) == 1.0, [line for line in srv.metrics().splitlines() if "refused" in line]

        log = srv.log.read_text(errors="replace")
        warnings = [line for line in log.splitlines() if f"adapter '{BAD}'" in line and "refused" in line]
        assert len(warnings) == 1 and str(catalogue_file.parent / BAD) in warnings[0], warnings
    finally:
        srv.stop()


def test_strict_adapters_fails_the_start_cleanly(model_dir, catalogue_file, tmp_path, make_server):
    srv = make_server(model_dir, tmp_path, {"strict_adapters": "true"}, catalogue_file=catalogue_file, wait=False)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and srv.process.poll() is None:
            if "engine failed to start" in srv.log_tail(400):
                break
            time.sleep(0.5)
        srv.wait_exit(60)  # tritonserver (--exit-on-error, the default) exits: not all models loaded
        log = srv.log.read_text(errors="replace")
        failed = [line for line in log.splitlines() if "engine failed to start" in line]
        assert any(f"'{BAD}'" in line and REASON in line for line in failed), srv.log_tail()
        assert not srv.model_ready("generator")
        assert srv.process.returncode not in (None, 0), srv.log_tail()
        crashes = [line for line in log.splitlines() if any(sign in line for sign in CRASH_SIGNS)]
        assert not crashes, crashes
    finally:
        srv.stop()

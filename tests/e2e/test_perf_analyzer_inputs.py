"""perf/server/perf_analyzer.py makes its inputs from the adapters the running server lists."""

from __future__ import annotations

import json

import pytest

from perf.server.perf_analyzer import main

pytestmark = [pytest.mark.e2e]


def test_inputs_name_only_the_servers_adapters(server, tmp_path):
    assert main(["--url", server.grpc_url, "--out", str(tmp_path), "--inputs-only", "--count", "40"]) == 0
    adapters = json.loads((tmp_path / "inputs" / "adapters.json").read_text())
    assert adapters == sorted(server.catalogue)
    for model in ("generator", "llm"):
        data = json.loads((tmp_path / "inputs" / f"{model}_input.json").read_text())["data"]
        assert len(data) == 40
        assert {entry["lora_name"][0] for entry in data} <= set(adapters)

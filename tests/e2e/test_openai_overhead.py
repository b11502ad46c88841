"""perf/server/openai_overhead.py on the CPU with the embedded model: both paths run the same requests to the end
(a smoke test of the GPU measurement's command; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_overhead_command_runs_both_paths(server, openai_front, tmp_path):
    out = tmp_path / "overhead.json"
    command = [sys.executable, "-m", "perf.server.openai_overhead", "--grpc", server.grpc_url, "--openai",
               openai_front.url, "--requests", "6", "--prompt-words", "8", "--max-tokens", "8", "--processes", "2",
               "--warmup", "1", "--json", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "openai / grpc throughput:" in done.stdout
    report = json.loads(out.read_text())
    for path in ("grpc", "openai"):
        result = report["results"][path]
        assert result["requests"] == 6 and result["errors"] == 0, result
        assert result["output_tokens"] == 6 * 8, result  # ignore_eos: exactly max_tokens each
    assert report["ratio"] > 0
    assert set(report["adapters"]) == {"base", *server.catalogue}

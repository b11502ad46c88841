"""perf/server/locustfile.py headless for a few seconds against the real server (loopback only)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _stats(path: Path) -> dict[str, dict]:
    with open(path) as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_locust_headless(server, tmp_path, transport):
    env = {**os.environ, "MANYLORA_TRANSPORT": transport, "MANYLORA_GRPC_URL": server.grpc_url,
           "MANYLORA_INPUT_RANGE": "4,16", "MANYLORA_OUTPUT_RANGE": "4,16", "PYTHONPATH": str(REPO)}
    prefix = tmp_path / "locust"
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "perf" / "server" / "locustfile.py"), "--headless",
               "-u", "4", "-r", "4", "-t", "5s", "--host", f"http://{server.http_url}", "--csv", str(prefix),
               "--only-summary"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    stats = _stats(Path(f"{prefix}_stats.csv"))
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert "generate" in stats and "ttft" in stats, log
    assert int(stats["generate"]["Request Count"]) > 0, log
    assert int(stats["ttft"]["Request Count"]) > 0, log
    assert int(stats["Aggregated"]["Failure Count"]) == 0, (log, (tmp_path / "locust_failures.csv").read_text())
    assert done.returncode == 0, log

"""perf/server/locustfile.py in OpenAI mode (MANYLORA_TRANSPORT=openai) headless for a few seconds against the real
OpenAI-compatible front (loopback only)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_locust_drives_the_openai_front(openai_front, tmp_path):
    env = {**os.environ, "MANYLORA_TRANSPORT": "openai", "MANYLORA_INPUT_RANGE": "4,16",
           "MANYLORA_OUTPUT_RANGE": "4,16", "MANYLORA_BASE_FRACTION": "0.2", "PYTHONPATH": str(REPO)}
    env.pop("MANYLORA_GRPC_URL", None)
    prefix = tmp_path / "locust"
    command = [sys.executable, "-m", "locust", "-f", str(REPO / "perf" / "server" / "locustfile.py"), "--headless",
               "-u", "4", "-r", "4", "-t", "5s", "--host", openai_front.url, "--csv", str(prefix), "--only-summary"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    assert ("openai-sse", "generate") in stats and ("openai-sse", "ttft") in stats, (log, list(stats))
    assert int(stats[("openai-sse", "generate")]["Request Count"]) > 0, log
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0, (log, (tmp_path / "locust_failures.csv").read_text())
    assert done.returncode == 0, log
    # every locust request was answered by the front's completions route
    metrics = openai_front.metrics()
    served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith('manylora_openai_requests_total{route="/v1/completions",status="200"}'))
    assert served >= int(stats[("openai-sse", "generate")]["Request Count"]), metrics

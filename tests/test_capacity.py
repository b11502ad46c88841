"""perf/capacity/ end to end on the tiny shape: the in-process engine and the real tritonserver (streaming and
non-streaming, and the text ensemble) on the same requests, offline and in a short open-loop sweep, then a short soak
through the text ensemble.

One run of the command (about a minute on two CPU cores) feeds every test here; they read what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = (0, 4)
REQUESTS = 32
FRACTIONS = (0.5, 1.2)
OFFLINE_TARGETS = ("engine", "server_stream", "server_nostream")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The capacity command's summary.json, with its output folder and its own printout."""
    if not (Path(sysconfig.get_paths()["purelib"]) / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        pytest.skip("no tritonserver (pip install --no-deps nvidia-pytriton==0.7.0)")
    root = tmp_path_factory.mktemp("capacity")
    out = root / "out"
    command = [
        sys.executable, "-m", "perf.capacity", "--shape", "tiny", "--device", "cpu",
        "--requests", str(REQUESTS), "--adapters", ",".join(map(str, ADAPTERS)),
        "--targets", ",".join(OFFLINE_TARGETS), "--llm", "--parts", "offline,sweep",
        "--sweep-fractions", ",".join(map(str, FRACTIONS)), "--sweep-duration", "3", "--sweep-warmup", "1",
        "--sweep-drain", "5", "--soak", "4", "--soak-target", "llm", "--soak-interval", "1",
        "--keep-output-ids", "--fresh", "--workdir", str(root / "work"), "--out", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OUT", None)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "out": out, "stdout": proc.stdout}


def _records(out: Path, target: str, n: int) -> list[dict]:
    path = out / "runs" / f"{target}_n{n}_offline.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("target", OFFLINE_TARGETS)
def test_every_request_completed_with_exactly_its_tokens(run, target):
    for n in ADAPTERS:
        records = _records(run["out"], target, n)
        assert len(records) == REQUESTS
        for r in records:
            assert r["error"] is None and r["end_s"] is not None, r
            assert sum(r["chunk_tokens"]) == r["output_tokens_requested"] == len(r["output_ids"]), r
            assert r["send_s"] <= r["first_token_s"] <= r["end_s"]
        if target == "server_nostream":  # one response with every token
            assert all(len(r["chunk_tokens"]) == 1 for r in records)
        if target == "server_stream":
            assert any(len(r["chunk_tokens"]) > 1 for r in records), "nothing came back in more than one response"


def test_every_target_got_the_same_requests(run):
    for n in ADAPTERS:
        shapes = {
            target: [(r["request"], r["adapter"], r["prompt_tokens"], r["output_tokens_requested"])
                     for r in sorted(_records(run["out"], target, n), key=lambda r: r["request"])]
            for target in OFFLINE_TARGETS
        }
        assert shapes["engine"] == shapes["server_stream"] == shapes["server_nostream"]
        adapters = {a for _, a, _, _ in shapes["engine"]}
        assert adapters == {None} if n == 0 else adapters <= {f"lora-{i:04d}" for i in range(n)} and len(adapters) > 1


def test_server_outputs_are_token_identical_to_the_engine(run):
    for n in ADAPTERS:
        engine = {r["request"]: r["output_ids"] for r in _records(run["out"], "engine", n)}
        for target in ("server_stream", "server_nostream"):
            served = {r["request"]: r["output_ids"] for r in _records(run["out"], target, n)}
            assert served == engine, f"{target} n={n}"
    identity = run["summary"]["token_identity"]
    assert {(t["target"], t["adapters"]) for t in identity} == {(t, n) for t in OFFLINE_TARGETS[1:] for n in ADAPTERS}
    assert all(t["identical"] == t["compared"] == REQUESTS for t in identity)


def test_summary_has_the_table_rows(run):
    summary = run["summary"]
    rows = {(r["target"], r["adapters"]): r for r in summary["offline_table"]}
    for target in OFFLINE_TARGETS:
        for n in ADAPTERS:
            row = rows[(target, n)]
            assert row["completed"] == row["exact_length"] == REQUESTS and not row["capped"]
            assert row["req_per_s"] > 0 and row["output_tok_per_s"] > row["req_per_s"]
            assert row["ratio_req_per_s"] == pytest.approx(row["req_per_s"] / rows[("engine", n)]["req_per_s"])
    assert rows[("engine", 0)]["ratio_req_per_s"] == 1.0
    for key in ("command", "date", "gpu", "versions"):
        assert summary[key]
    assert summary["gpu"] == "cpu" and "torch" in summary["versions"] and "tritonserver" in summary["versions"]
    markdown = (run["out"] / "summary.md").read_text()
    for text in ("- command: `python -m perf.capacity", "- GPU: cpu", "## 1. Offline", "## 2. Open-loop", "## 3. Soak"):
        assert text in markdown
    printed = run["stdout"][run["stdout"].rindex("results in"):]  # the short table printed last
    assert "| in-process engine |" in printed and "| server, streaming |" in printed and "knee of" in printed
    llm = [r for r in summary["offline_table"] if r["target"] == "llm"]
    # ignore_eos through sampling_parameters; each chunk's tokens from its num_output_tokens
    assert llm and all(r["completed"] == r["exact_length"] == REQUESTS for r in llm)


def test_sweep_points_and_knee(run):
    sweeps = run["summary"]["sweeps"]
    assert set(sweeps) == {"engine|4", "server_stream|4"}
    for sweep in sweeps.values():
        rates = [p["offered_rps"] for p in sweep["points"]]
        assert [p["fraction"] for p in sweep["points"]] == list(FRACTIONS)
        capacity = run["summary"]["offline"][f"{sweep['target']}|4"]["req_per_s"]
        assert rates == pytest.approx([f * capacity for f in FRACTIONS])
        assert sweep["knee"] == "none" or sweep["knee"] in [round(r, 4) for r in rates]
        assert (sweep["knee_rps"] is None) == (sweep["knee"] == "none")
        for p in sweep["points"]:
            assert p["sent"] > 0 and p["completed"] + p["unfinished"] + p["failed"] == p["sent"]
            assert p["failed"] == 0, p["first_error"]
            records = (run["out"] / "runs" / f"{sweep['target']}_n4_x{p['fraction']:.2f}.jsonl").read_text()
            assert len(records.splitlines()) == p["sent"]
    assert (run["out"] / "sweep_throughput.png").is_file() and (run["out"] / "sweep_ttft_p99.png").is_file()


def test_soak_sampled_the_server_and_its_stubs(run):
    (soak,) = run["summary"]["soak"]
    assert soak["load"]["sent"] > 0 and soak["load"]["failed"] == 0
    memory = soak["memory"]
    assert memory["samples"] >= 3
    names = list(memory["host_rss"])
    assert soak["target"] == "llm"  # through the text ensemble: its pre- and postprocessing stubs are sampled too
    for process in ("tritonserver", "stub:generator", "stub:preprocessing", "stub:postprocessing"):
        assert any(n.startswith(process) for n in names), (process, names)
    total = memory["host_rss"]["total"]
    assert 0 < total["start_mb"] <= total["max_mb"] and total["slope_mb_per_min"] is not None


def test_clients_report_their_cpu(run):
    for key in ("server_stream|0", "server_nostream|4"):
        clients = run["summary"]["offline"][key]["meta"]["clients"]
        assert len(clients) == 2 and all(c["cpu_s"] > 0 and c["wall_s"] > 0 for c in clients)
        assert sum(c["requests"] for c in clients) == REQUESTS


def test_each_run_carries_its_engines_counters(run):
    """The engine's counters over each offline run, the server's engine's through its stats: a step makes at most
    one token a request, so a run takes at least as many steps as its longest output; on the CPU no step replays a
    CUDA graph."""
    offline = run["summary"]["offline"]
    for target in (*OFFLINE_TARGETS, "llm"):
        for n in ADAPTERS:
            counters = offline[f"{target}|{n}"]["meta"]["engine_counters"]
            longest = max(r["output_tokens_requested"] for r in _records(run["out"], target, n))
            assert counters["steps"] >= longest, (target, n, counters)
            assert counters["steps_eager"] == counters["steps"], (target, n, counters)
            assert counters["steps_decode_graph"] == counters["steps_mixed_graph"] == 0, (target, n, counters)
    assert "| server, streaming | 4 |" in (run["out"] / "summary.md").read_text()


def test_merge_rebuilds_the_summary_from_the_store(run, tmp_path):
    """--merge (for calls on machines given back in between) gives the same table from the call's store.json."""
    out = tmp_path / "merged"
    command = [sys.executable, "-m", "perf.capacity", "--merge", str(run["out"]), str(run["out"] / "store.json"),
               "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads((out / "summary.json").read_text())
    assert merged["offline_table"] == run["summary"]["offline_table"]
    assert merged["token_identity"] == run["summary"]["token_identity"] and merged["calls"] == run["summary"]["calls"]
    assert (out / "summary.md").read_text().startswith("# Capacity: tiny on cpu")

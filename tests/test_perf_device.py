"""perf/device: the GPU machine's entry point, checked on the CPU: the server's venv made from a .gpu/ folder (with
stand-ins for the server, numpy and the wheels), the command line, time limits, and (e2e) a server part's dry run
on the tiny shape with a stand-in perf_analyzer."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from perf.device.__main__ import main
from perf.device.part import Part, run_logged
from perf.device.server_env import READY, VenvError, ensure_venv, make_venv

REPO = Path(__file__).resolve().parents[1]


def _txz(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _wheel(folder: Path, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 7\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as z:
        for n, text in files.items():
            z.writestr(n, text)


def test_server_venv_is_made_from_the_gpu_folder(tmp_path):
    gpu, venv = tmp_path / "gpu", tmp_path / "venv"
    gpu.mkdir()
    with pytest.raises(VenvError, match="tritonserver.txz"):
        make_venv(gpu, venv)
    _txz(gpu / "tritonserver.txz", {"pytriton/tritonserver/bin/tritonserver": "#!/bin/sh\n"})
    _txz(gpu / "numpy-1.26.4-cp312.txz", {"numpy_stand_in/__init__.py": "VERSION = '1.26.4'\n"})
    _wheel(gpu / "wheels", "client_stand_in")
    python = ensure_venv(gpu, venv)
    assert (venv / READY).is_file() and python == venv / "bin" / "python"
    code = ("import sysconfig, numpy_stand_in, client_stand_in, perf.device; "
            "print(numpy_stand_in.VERSION, client_stand_in.VALUE, sysconfig.get_paths()['purelib'])")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr
    version, value, site = done.stdout.split()
    assert (version, value) == ("1.26.4", "7")
    assert (Path(site) / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file()
    assert (Path(site) / "manylora.pth").read_text().strip() == str(REPO)
    # the image's packages come last: the site-packages this interpreter takes torch from
    torch_site = (Path(site) / "zz_image_site.pth").read_text().strip()
    assert (Path(torch_site) / "torch").is_dir()
    marker = (venv / READY).stat().st_mtime_ns
    ensure_venv(gpu, venv)  # complete: not made again
    assert (venv / READY).stat().st_mtime_ns == marker


def test_a_step_past_its_limit_is_stopped_with_124(tmp_path):
    t0 = time.monotonic()
    rc = run_logged([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                    tmp_path / "log.txt", timeout_s=1)
    assert rc == 124 and time.monotonic() - t0 < 30
    assert "started" in (tmp_path / "log.txt").read_text()


def test_a_part_writes_its_summary_and_archive(tmp_path, monkeypatch):
    monkeypatch.setattr("perf.device.part.WORK_ROOT", tmp_path / "work")
    part = Part("demo", tmp_path / "out")
    assert part.python_step("hello", "platform", [], "hello.txt", 30) == 0
    part.add("section", "text")
    summary = part.finish()
    assert "hello rc=0 at" in summary and "== section\ntext" in summary
    assert (tmp_path / "out" / "demo.txt").read_text() == summary
    with tarfile.open(tmp_path / "out" / "demo.tgz") as tar:
        assert {"demo/hello.txt", "demo/times.txt"} <= set(tar.getnames())


def test_the_command_line_refuses_what_a_part_does_not_take(capsys):
    assert main(["profile", "--no-such-option"]) == 2
    assert "unknown arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["no-such-part"])


FAKE_PERF_ANALYZER = """#!{python}
import json, sys
args = sys.argv[1:]
if "--help" in args:
    print("--concurrency-range <start:end:step>")
    sys.exit(0)
with open({calls!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
open(args[args.index("-f") + 1], "w").write("Concurrency,Inferences/Second\\n1,1.0\\n")
print("Throughput: 1.0 infer/sec")
"""


@pytest.mark.e2e
def test_the_perf_analyzer_part_on_the_cpu(tmp_path):
    """The server part end to end on the tiny shape: the checkpoint, tritonserver from this Python, perf_analyzer's
    inputs from the adapters that server lists, one run per model and load."""
    if not (Path(sysconfig.get_paths()["purelib"]) / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        pytest.skip("no tritonserver (pip install --no-deps nvidia-pytriton==0.7.0)")
    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "perf_analyzer"
    fake.write_text(FAKE_PERF_ANALYZER.format(python=sys.executable, calls=str(calls)))
    fake.chmod(0o755)
    env = {**os.environ, "PA_BIN": str(fake), "PYTHONPATH": str(REPO)}
    port = 18700 + os.getpid() % 200 * 3
    command = [sys.executable, "-m", "perf.device", "perf-analyzer", "--shape", "tiny", "--device", "cpu",
               "--python", sys.executable, "--http-port", str(port), "--concurrency", "2", "--rates", "3",
               "--measure-ms", "500", "--out", str(tmp_path / "out")]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "perf_analyzer rc=0" in done.stdout, done.stdout
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    assert sorted((r[r.index("-m") + 1], r[-1]) for r in runs) == [("generator", "2"), ("generator", "3"),
                                                                   ("llm", "2"), ("llm", "3")]
    assert all(r[r.index("-u") + 1] == f"127.0.0.1:{port + 1}" for r in runs)
    with tarfile.open(tmp_path / "out" / "perf-analyzer.tgz") as tar:
        adapters = json.load(tar.extractfile("perf-analyzer/perf_analyzer/inputs/adapters.json"))
        requests = json.load(tar.extractfile("perf-analyzer/perf_analyzer/inputs/generator_input.json"))["data"]
    assert len(adapters) == 100 and adapters[0] == "lora-0000"
    assert {r["lora_name"][0] for r in requests} <= set(adapters)


@pytest.mark.e2e
def test_the_openai_overhead_part_on_the_cpu(tmp_path):
    """The server started with its OpenAI front (serve.py --openai-port), then the same requests through gRPC and
    through the front: both paths finish every request and the summary gives their ratio."""
    if not (Path(sysconfig.get_paths()["purelib"]) / "pytriton" / "tritonserver" / "bin" / "tritonserver").is_file():
        pytest.skip("no tritonserver (pip install --no-deps nvidia-pytriton==0.7.0)")
    port = 19300 + os.getpid() % 200 * 4
    command = [sys.executable, "-m", "perf.device", "openai-overhead", "--shape", "tiny", "--device", "cpu",
               "--python", sys.executable, "--http-port", str(port), "--openai-port", str(port + 3),
               "--overhead-args", "--requests 12 --max-tokens 6 --prompt-words 6 --processes 2",
               "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "openai overhead rc=0" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("== openai overhead"):]
    paths = {json.loads(line)["path"]: json.loads(line) for line in summary.splitlines() if line.startswith("{")}
    assert {p: (r["requests"], r["errors"], r["output_tokens"]) for p, r in paths.items()} == {
        "grpc": (12, 0, 72), "openai": (12, 0, 72)}
    assert "openai / grpc throughput:" in summary

"""A stock tritonserver on a rendered repository whose models run in a packed environment: no wrapper process,
no virtual environment on the server's PATH, no PYTHONPATH.

python -m manylora.deploy pack-env builds the environment (symlinked into this installation: the same layout as
a copied one, packed in seconds), render writes the repository naming it by EXECUTION_ENV_PATH, and the server is
started with the flags docs/deployment.md gives. Greedy outputs of the base model and two adapters equal
transformers + peft's; the server stays ready; the stubs ran with the environment's PATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import MAX_MODEL_LEN, Server, serve
from test_e2e_oracle import MAX_NEW_TOKENS, check_mixed_batches, peft_reference

from manylora.deploy.packed_env import MANIFEST, PackSpec, pack_environment
from manylora.deploy.repository import ENVIRONMENT_PARAMETER, RenderSpec, render_repository
from manylora.deploy.server_flags import PYTHON_BACKEND_FLAGS, listen_flags, restriction_flags
from manylora.deploy.shm_regions import new_prefix, prefix_flag

pytestmark = pytest.mark.e2e

ADAPTERS = ("pirate", "shout")
STUB = "triton_python_backend_stub"
EXIT_TIMEOUT_S = 10
REAP_S = 15


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stub_environments(pid: int) -> list[dict[str, str]]:
    """The environment variables of the server's Python-backend stubs."""
    environments = []
    for child in _children(pid):
        try:
            if STUB not in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                continue
            raw = Path(f"/proc/{child}/environ").read_bytes()
        except OSError:
            continue
        items = raw.decode(errors="replace").split("\0")
        environments.append(dict(item.split("=", 1) for item in items if "=" in item))
    return environments


def _reap(pids: list[int]) -> list[str]:
    """Wait up to REAP_S for ``pids`` to exit; kill the ones left (this test started them) and name them."""
    deadline = time.monotonic() + REAP_S
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists()]
    names = []
    for pid in alive:
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")[:120])
            os.kill(pid, signal.SIGKILL)
    return names


def test_stock_server_runs_the_models_in_the_packed_environment(model_dir, tmp_path):
    stub = serve.install_stub()  # the server's stub for this Python (what a fleet's image carries)
    env = pack_environment(PackSpec(out=tmp_path / "env", link="symlink", stub=stub))
    assert (env / MANIFEST).is_file()
    catalogue = {name: path for name, path in json.loads((model_dir / "catalogue.json").read_text()).items()
                 if name in ADAPTERS}
    assert sorted(catalogue) == sorted(ADAPTERS)
    catalogue_file = tmp_path / "catalogue.json"
    catalogue_file.write_text(json.dumps(catalogue))
    repository = render_repository(RenderSpec(base_model=model_dir / "base", out=tmp_path / "repository",
                                              adapters=catalogue_file, params={"max_model_len": str(MAX_MODEL_LEN)},
                                              environment=env, relative_paths=True))
    # paths from each model's directory ($$TRITON_MODEL_DIRECTORY/..): the models expand them themselves
    generator_config = (repository / "generator" / "config.pbtxt").read_text()
    assert f'"{ENVIRONMENT_PARAMETER}"' in generator_config
    assert 'key: "base_model" value: { string_value: "$$TRITON_MODEL_DIRECTORY/..' in generator_config

    home = serve.triton_home()
    http_port, grpc_port, metrics_port = serve.free_ports(3)
    key, shm_prefix = secrets.token_urlsafe(16), new_prefix()
    command = [str(home / "bin" / "tritonserver"), f"--model-repository={repository}",
               f"--backend-directory={home / 'backends'}",
               *listen_flags("127.0.0.1", http_port, grpc_port, metrics_port), *PYTHON_BACKEND_FLAGS,
               prefix_flag(shm_prefix), *restriction_flags(key), f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
    # a clean environment: the system PATH, no virtual environment, no PYTHONPATH; the server binary's own
    # libraries only (the wheel keeps them apart; an NGC image has them in place)
    clean = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path),
             "LD_LIBRARY_PATH": str(serve.site_packages() / "nvidia_pytriton.libs")}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=clean, cwd=tmp_path)
    server = Server(http_url=f"127.0.0.1:{http_port}", grpc_url=f"127.0.0.1:{grpc_port}", http_port=http_port,
                    grpc_port=grpc_port, base_model=model_dir / "base", catalogue=catalogue, log=log, process=process,
                    metrics_port=metrics_port, admin_key=key, shm_prefix=shm_prefix)
    try:
        server.wait_ready()
        stubs = _stub_environments(process.pid)
        assert len(stubs) >= 3, f"expected the three models' stubs, found {len(stubs)}"
        for variables in stubs:
            assert variables["PATH"].startswith(f"{env}/bin:"), variables["PATH"]
            assert "PYTHONPATH" not in variables
            assert ".venv" not in variables["PATH"]
            assert variables["LD_LIBRARY_PATH"].startswith(f"{env}/lib"), variables["LD_LIBRARY_PATH"]

        from manylora.engine.requests.detokenize import load_tokenizer

        tokenizer = load_tokenizer(model_dir / "base")
        reference = peft_reference(SimpleNamespace(base_model=model_dir / "base", catalogue=catalogue), tokenizer)
        client = server.client()
        check_mixed_batches(client, tokenizer, reference, catalogue)
        # text through the ensemble: preprocessing and postprocessing run in the environment too
        for adapter in (None, *ADAPTERS):
            prompt = next(p for a, p in reference if a == adapter)
            expected = tokenizer.decode(reference[(adapter, prompt)], skip_special_tokens=True)
            assert client.generate(prompt, adapter=adapter, max_tokens=MAX_NEW_TOKENS) == expected
        assert server.ready() and process.poll() is None
        assert "Using Python execution env" in log.read_text(errors="replace")
    finally:
        started = _children(process.pid)  # the stubs and the engine process
        server.stop()
        leftover = _reap(started)
    # stopped by SIGTERM, not killed. The generator's engine process sometimes outlives Triton's exit timeout on a
    # loaded machine (seen with 2 CPU cores shared); Triton then exits 1 by itself, after unloading the rest
    log_text = log.read_text(errors="replace")
    assert process.returncode in (0, -15) or (process.returncode == 1 and "Exit timeout expired" in log_text), \
        server.log_tail()
    if leftover:  # a known fault of the generator's shutdown, not of the packed environment: reported, cleaned up
        warnings.warn(f"processes of the stopped server still ran after {REAP_S} s (killed): {leftover}", stacklevel=1)

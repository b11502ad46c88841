"""deploy/Dockerfile and deploy/kubernetes.yaml, checked without Docker or a cluster: the manifest parses, its
server flags are the ones manylora.deploy.server_flags gives (ports, addresses, restricted APIs), its probes and
volumes are the ones docs/deployment.md describes, and the Dockerfile copies files that exist and runs modules
that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from manylora.deploy.__main__ import build_parser
from manylora.deploy.server_flags import ADMIN_HEADER, PYTHON_BACKEND_FLAGS, listen_flags, restriction_flags

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # tritonserver 2.51, the supported version


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    assert sorted(by_kind) == ["Deployment", "Service", "ServiceMonitor"]
    return by_kind


def _container(manifests, name: str, init: bool = False) -> dict:
    spec = manifests["Deployment"]["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def test_server_flags_are_the_deploy_modules(manifests):
    server = _container(manifests, "tritonserver")
    assert server["command"][:2] == ["sh", "-c"] and "exec tritonserver \"$@\"" in server["command"][2]
    args = server["args"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    # every endpoint on every interface (probes and the Service reach the pod's address), on the declared ports
    for flag in listen_flags("0.0.0.0", ports["http"], ports["grpc"], ports["metrics"]):
        assert flag in args
    for flag in PYTHON_BACKEND_FLAGS:
        assert flag in args
    key = "$(MANYLORA_ADMIN_KEY)"  # Kubernetes puts the Secret's value here
    for flag in restriction_flags("KEY"):
        assert flag.replace(f"{ADMIN_HEADER}=KEY", f"{ADMIN_HEADER}={key}") in args
    repository = next(a.split("=", 1)[1] for a in args if a.startswith("--model-repository="))
    render = build_parser().parse_args(_container(manifests, "render", init=True)["command"][3:])
    assert render.command == "render" and render.out == repository
    env = {e["name"]: e for e in server["env"]}
    assert env["MANYLORA_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_server_container_clears_what_a_killed_predecessor_left_and_execs_tritonserver(manifests, tmp_path):
    """The container's shell line, run with a stand-in tritonserver and a stand-in /dev/shm: Triton's default-named
    regions go, nothing else there does, and tritonserver gets the manifest's arguments unchanged (exec: the same
    process, so it takes the pod's signals)."""
    server = _container(manifests, "tritonserver")
    sh, flag, line, name = server["command"]
    assert (sh, flag, name) == ("sh", "-c", "tritonserver") and line.count("/dev/shm/") == 1
    shm = tmp_path / "shm"
    shm.mkdir()
    left = [shm / f"triton_python_backend_shm_region_{os.urandom(6).hex()}" for _ in range(4)]
    kept = [shm / "manylora-adapter-17-ab12", shm / f"manylora_{os.urandom(6).hex()}_region", shm / "other"]
    for path in left + kept:
        path.write_bytes(b"x")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tritonserver"
    fake.write_text("#!/bin/sh\n" 'echo "$$"\n' 'for a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    args = [*server["args"], "an argument with spaces"]
    shell = subprocess.Popen(["sh", "-c", line.replace("/dev/shm/", f"{shm}/"), "tritonserver", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    out, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)
    pid, *given = out.splitlines()
    assert int(pid) == shell.pid  # exec'd: tritonserver is the container's process, not a child of the shell
    assert given == args


def test_probes_volumes_and_metrics(manifests):
    deployment = manifests["Deployment"]
    server = _container(manifests, "tritonserver")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    liveness = server["livenessProbe"]["exec"]["command"]
    assert liveness[:2] == ["python3", "/opt/manylora/healthcheck.py"]
    assert liveness[liveness.index("--url") + 1] == f"127.0.0.1:{ports['grpc']}"
    # the check waits up to --timeout for each of its two models (generator, then llm)
    assert server["livenessProbe"]["timeoutSeconds"] > 2 * int(liveness[liveness.index("--timeout") + 1])
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["models"]["readOnly"] is True
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service_ports = {p["name"]: p for p in manifests["Service"]["spec"]["ports"]}
    assert {name: p["targetPort"] for name, p in service_ports.items()} == {n: n for n in ports}
    endpoint = manifests["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selector = manifests["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= manifests["Service"]["metadata"]["labels"].items()


def _dockerfile() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_builds_from_the_supported_triton_and_copies_what_exists():
    lines = _dockerfile()
    args = dict(line[4:].split("=", 1) for line in lines if line.startswith("ARG ") and "=" in line)
    assert args["TRITON_IMAGE"] == TRITON_IMAGE
    assert "FROM ${TRITON_IMAGE}" in lines
    workdir = next(line.split()[1] for line in lines if line.startswith("WORKDIR "))
    copied = {}
    for line in lines:
        if line.startswith("COPY "):
            *sources, target = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), f"Dockerfile: COPY {source}: no such file in the repository"
                copied[source] = target
    # what pip builds: the packaging inputs, the package, the template; the liveness probe's script
    for needed in ("pyproject.toml", "setup.py", "manylora", "model_repository"):
        assert needed in copied
    assert str(Path(workdir) / copied["scripts/healthcheck.py"]) == "/opt/manylora/healthcheck.py"


def test_dockerfile_runs_modules_that_exist():
    run = " ".join(line[4:] for line in _dockerfile() if line.startswith("RUN "))
    for module in re.findall(r"python3 -m ([\w.]+)", run):
        assert module == "pip" or importlib.util.find_spec(module), module
    for statement in re.findall(r'python3 -c "([^"]+)"', run):
        for module in re.findall(r"import ([\w.]+(?:, [\w.]+)*)", statement):
            for name in module.split(", "):
                assert importlib.util.find_spec(name), f"Dockerfile imports {name}, which does not exist"
    assert "./src" in shlex.split(run)


def test_deploy_readme_points_to_the_deployment_guide():
    readme = (DEPLOY / "README.md").read_text()
    assert "../docs/deployment.md" in readme
    guide = (REPO / "docs" / "deployment.md").read_text()
    for flag in PYTHON_BACKEND_FLAGS:  # the guide gives the flags the models need, as the code has them
        assert flag in guide
    assert TRITON_IMAGE.split(":")[1].split("-")[0] in guide

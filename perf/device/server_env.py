"""The server's Python on a fresh GPU machine that has torch and Triton but no package registry.

The Triton 2.51 Python stub takes its packages from the ``python3`` first on ``PATH`` (not from ``PYTHONPATH``)
and breaks under numpy 2 (tensors built from numpy arrive empty, BYTES inputs crash it), while the image's
python3 has numpy 2 for its transformers. So the server runs from a venv (``/tmp/venv``) that holds, in this
order, numpy 1.26, the tritonserver binary, tritonclient, this repository (``manylora.pth``) and last the
image's site-packages (``zz_image_site.pth``: torch, triton, transformers). What it unpacks comes in the ignored
folder ``.gpu/`` (made on a machine with PyPI: docs/development.md, "Running on a GPU machine"):

    .gpu/tritonserver.txz         pytriton/tritonserver + nvidia_pytriton.libs from nvidia-pytriton 0.7.0
    .gpu/numpy-1.26.4-cp312.txz   the numpy 1.26.4 cp312 wheel's contents
    .gpu/wheels/*.whl             tritonclient, python-rapidjson (cp312)
    .gpu/pa/*.whl                 perf-analyzer 2.60 (optional; its binary needs glibc >= 2.38)
    .gpu/front/*.whl              fastapi, uvicorn, httpx, jinja2 and their requirements, cp312 (optional: the OpenAI
                                  front, perf.device openai-overhead)

The venv is made once per machine: a marker written last (``/tmp/venv/.manylora_ready``) says it is complete, so
a venv that an earlier failure left half made is made again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / ".gpu"
VENV = Path("/tmp/venv")
READY = ".manylora_ready"
SERVER_TXZ = "tritonserver.txz"
NUMPY_TXZ = "numpy-1.26.4-cp312.txz"


class VenvError(RuntimeError):
    """The server's venv cannot be made: what it is made from is not on this machine, or does not install here."""


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise VenvError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout.strip()


def make_venv(gpu_dir: Path = GPU_DIR, venv: Path = VENV, python: str = sys.executable, repo: Path = REPO) -> None:
    """Make ``venv`` from ``gpu_dir`` with ``python`` (the image's python3, which has torch), from scratch."""
    needed = [gpu_dir / SERVER_TXZ, gpu_dir / NUMPY_TXZ]
    wheels = sorted((gpu_dir / "wheels").glob("*.whl"))
    missing = [str(p) for p in needed if not p.is_file()] + ([] if wheels else [f"{gpu_dir}/wheels/*.whl"])
    if missing:
        raise VenvError(f"missing {', '.join(missing)}: copy .gpu/ to this machine with the working tree "
                           "(docs/development.md, 'Running on a GPU machine')")
    torch_site = _run([python, "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"])
    shutil.rmtree(venv, ignore_errors=True)
    _run([python, "-m", "venv", str(venv)])
    venv_python = str(venv / "bin" / "python")
    site = Path(_run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))
    for archive in (gpu_dir / NUMPY_TXZ, gpu_dir / SERVER_TXZ):
        _run(["tar", "xJf", str(archive), "-C", str(site)])
    _run([venv_python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, wheels)])
    front = sorted((gpu_dir / "front").glob("*.whl"))  # the OpenAI front's packages (optional)
    if front:
        _run([venv_python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, front)])
    perf_analyzer = sorted((gpu_dir / "pa").glob("*.whl"))
    if perf_analyzer:
        _run([venv_python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, perf_analyzer)])
    (site / "manylora.pth").write_text(f"{repo}\n")
    (site / "zz_image_site.pth").write_text(f"{torch_site}\n")
    (venv / READY).touch()


def ensure_venv(gpu_dir: Path = GPU_DIR, venv: Path = VENV, python: str = sys.executable) -> Path:
    """The venv's python, the venv made first unless it is complete; raises VenvError when it cannot be made."""
    if not (venv / READY).is_file():
        make_venv(gpu_dir, venv, python)
    return venv / "bin" / "python"


def server_environ(venv: Path = VENV, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to run the server's Python in: the venv first on PATH, this repository importable."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    return env

"""The package as pip builds it: one top-level name (manylora), the model repository template inside it, a license,
the extras; and an installed wheel that imports the engine and renders a repository outside the source tree.

The sdist and the wheel are built from a copy of the project's packaging inputs (nothing is written into the
source tree), the wheel from the unpacked sdist, as `pip install <sdist>` would; build isolation is off so that
nothing is downloaded (the venv's setuptools builds it).
"""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGING_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md")
TEMPLATE_MODELS = ("generator", "llm", "postprocessing", "preprocessing")


def _build(command: str, where: Path, out: Path) -> Path:
    code = f"from setuptools import build_meta as b; print(b.{command}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=where, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """{"sdist": .tar.gz, "wheel": .whl built from that sdist}."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    source.mkdir()
    for name in PACKAGING_INPUTS:
        shutil.copy2(REPO / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("manylora", "model_repository"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    dist = root / "dist"
    dist.mkdir()
    sdist = _build("build_sdist", source, dist)
    unpacked = root / "unpacked"
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    (project,) = unpacked.iterdir()
    wheel = _build("build_wheel", project, dist)
    return {"sdist": sdist, "wheel": wheel}


def test_wheel_installs_only_the_manylora_namespace(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"manylora", "manylora-0.1.0.dist-info"}, top
    # the model repository template travels inside the package: `render` works from an installed wheel
    for model in TEMPLATE_MODELS:
        assert f"manylora/deploy/model_repository/{model}/config.pbtxt" in names
    assert "manylora/deploy/model_repository/generator/1/model.py" in names
    assert "manylora/embedded/corpus.txt" in names  # package data
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if n.startswith(("manylora/tests", "manylora/perf"))]


def test_wheel_metadata_license_and_extras(built):
    with zipfile.ZipFile(built["wheel"]) as archive:
        meta = email.message_from_string(archive.read("manylora-0.1.0.dist-info/METADATA").decode())
        license_text = archive.read("manylora-0.1.0.dist-info/licenses/LICENSE").decode()
        top_level = archive.read("manylora-0.1.0.dist-info/top_level.txt").decode().split()
    assert top_level == ["manylora"]
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert set(meta.get_all("Provides-Extra")) == {"server", "openai", "bench", "dev"}
    requires = meta.get_all("Requires-Dist")
    by_extra = {extra: {re.match(r"[A-Za-z0-9_.-]+", r).group() for r in requires
                        if f'extra == "{extra}"' in r} for extra in ("server", "openai", "dev")}
    assert {"fastapi", "uvicorn", "jinja2"} <= by_extra["openai"]
    assert {"transformers", "peft"} <= by_extra["server"]
    assert {"openai", "httpx", "pytest"} <= by_extra["dev"]
    unconditional = {r.split(";")[0] for r in requires if "extra ==" not in r}
    assert any(r.startswith("torch") for r in unconditional)
    assert not any(r.startswith(("transformers", "peft", "fastapi")) for r in unconditional)


def test_sdist_holds_the_package_the_template_and_the_license_only(built):
    with tarfile.open(built["sdist"]) as archive:
        names = [m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name and m.isfile()]
    top = {name.split("/")[0] for name in names}
    assert top <= {"manylora", "manylora.egg-info", "model_repository", *PACKAGING_INPUTS, "PKG-INFO", "setup.cfg"}, top
    assert {"manylora", "model_repository", "LICENSE", "pyproject.toml", "setup.py"} <= top


def test_installed_wheel_imports_the_engine_and_renders(built, tmp_path):
    """The wheel installed (no dependencies) into a fresh venv that sees this venv's packages but not its editable
    manylora: manylora comes from the wheel, imports its engine, and renders the packaged template."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = Path(subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # a plain path entry: the dependencies, without running this venv's .pth files (its editable manylora finder)
    (site / "deps.pth").write_text(f"{deps}\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--quiet", str(built["wheel"])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code = (
        "import sys, manylora, manylora.engine.config, manylora.deploy.repository as r\n"
        "from transformers.utils.import_utils import _is_package_available\n"
        "assert _is_package_available('kernels')[0] is False\n"
        "print(manylora.__file__)\n"
        "print(r.template_repository())\n"
        "print(r.render_repository(r.RenderSpec(base_model=sys.argv[1], out=sys.argv[2])))\n"
    )
    done = subprocess.run([str(python), "-I", "-c", code, str(model), str(tmp_path / "repository")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    package, template, rendered = done.stdout.split()
    assert Path(package).is_relative_to(site)
    assert Path(template) == site / "manylora" / "deploy" / "model_repository"
    assert (Path(rendered) / "generator" / "config.pbtxt").is_file()


def test_no_other_top_level_name_in_this_venv(tmp_path):
    """The editable install maps manylora alone; `kernels` (a Hugging Face project's name) stays free. Asked of a
    fresh interpreter (-I: no current directory, no PYTHONPATH): pytest's own path holds tests/, whose kernels/
    directory is a namespace package there."""
    code = (
        "from importlib import metadata\n"
        "from transformers.utils.import_utils import _is_package_available\n"
        "assert _is_package_available('kernels')[0] is False, 'kernels importable'\n"
        "print(metadata.distribution('manylora').read_text('top_level.txt'))\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() in (["manylora"], ["None"])  # an editable install may carry no top_level.txt

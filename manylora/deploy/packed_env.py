"""Pack the Python environment the models run in, for a stock tritonserver's Python backend (EXECUTION_ENV_PATH).

What conda-pack does for a conda environment, done for the running interpreter: a self-contained prefix that
holds this Python (its binary, libpython, the standard library and headers) and, in site-packages, manylora with
every distribution its requirements need, as installed here. Nothing else of the current environment comes along.

    ENV/bin/python3.X            a copy of the interpreter (a copy, not a link: Python finds its prefix from it)
    ENV/bin/activate             PATH and LD_LIBRARY_PATH for the environment (Triton's launcher uses these two)
    ENV/lib/libpython3.X.so.1.0  the library the stub embeds
    ENV/lib/python3.X/           the standard library, lib-dynload, and the site-packages directory
    ENV/include/python3.X/       headers (OpenAI Triton compiles its kernel launchers against them)
    ENV/manylora-env.json        what was packed

How Triton's Python backend uses it: it runs the stub with ENV/bin first on PATH and ENV/lib first on
LD_LIBRARY_PATH (Triton 2.51 sources ENV/bin/activate; releases from 25.08 set the two variables themselves).
The stub loads ENV/lib/libpython3.X.so.1.0; its interpreter finds ``python3`` on PATH, ENV/bin/python3, and takes
ENV as its prefix. A directory is used in place; a ``.tar.gz`` is unpacked by the backend into a temporary
directory first. The stub must be built for the same Python 3.X (stub.py checks it).

``link="symlink"`` links the standard library and the packages' files instead of copying them: packing takes a
second and the result works on this machine only (tests, a server beside this installation). A ``.tar.gz``
always holds the files themselves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from manylora.deploy.stub import NGC_STUB, stub_python_version

PACKAGE = "manylora"
# what the three Python models import; the packed environment must import them on its own
MODEL_IMPORTS = ("manylora.engine.scheduling.engine_process", "manylora.engine.requests.detokenize",
                 "manylora.engine.requests.prompt_guard", "numpy")
MANIFEST = "manylora-env.json"
LINK_MODES = ("copy", "symlink")
# parts of the standard library the models never use (tests, GUI, installers) and the static library
STDLIB_LEFT_OUT = ("site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
                   "lib2to3", "__pycache__")
_CONFIG_DIR = re.compile(r"config-3\.\d+.*")
ACTIVATE = """\
# The manylora packed environment. Triton's Python backend sources this file (2.51) or sets the same PATH and
# LD_LIBRARY_PATH itself (25.08 and later) before it starts the stub; `source bin/activate` works in a shell too.
_manylora_env="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
export PATH="$_manylora_env/bin${PATH:+:$PATH}"
export LD_LIBRARY_PATH="$_manylora_env/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONNOUSERSITE=1
unset PYTHONHOME PYTHONPATH _manylora_env
"""


class PackError(RuntimeError):
    """The environment cannot be packed; the message says what is missing and what to do."""


@dataclass(frozen=True)
class PackSpec:
    """What to pack.

    out: the environment to write: a directory, or a file whose name ends in .tar.gz. An existing one is replaced
        only if it is a packed environment.
    link: for a directory, "copy" (self-contained) or "symlink" (links into this installation; this machine only).
    stub: the Python-backend stub the environment is for; its Python must be this interpreter's. None: the NGC
        image's stub where it exists, else no check.
    requirements: requirement strings to pack besides manylora; None: manylora's own requirements.
    compresslevel: gzip level of a .tar.gz (1 fastest, 9 smallest).
    """

    out: Path
    link: str = "copy"
    stub: Path | None = None
    requirements: tuple[str, ...] | None = None
    compresslevel: int = 4


def pack_environment(spec: PackSpec) -> Path:
    """Write the environment ``spec`` describes; return its path."""
    if spec.link not in LINK_MODES:
        raise ValueError(f"link must be one of {LINK_MODES}, got {spec.link!r}")
    out = Path(spec.out).resolve()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = spec.stub or (NGC_STUB if NGC_STUB.is_file() else None)
    if stub is not None:
        check_stub(stub, version)
    distributions = requirement_closure(_own_requirements() if spec.requirements is None else spec.requirements)
    imports = MODEL_IMPORTS if spec.requirements is None else (PACKAGE,)
    if out.name.endswith(".tar.gz"):
        _refuse_to_replace(out, archive=True)
        with tempfile.TemporaryDirectory(prefix=".manylora-env-", dir=out.parent) as work:
            env = Path(work) / "env"
            _build(env, version, distributions, "symlink", imports)
            _archive(env, out, spec.compresslevel)
        return out
    _refuse_to_replace(out, archive=False)
    _build(out, version, distributions, spec.link, imports)
    return out


def check_stub(stub: Path | str, version: str) -> None:
    """Raise PackError unless the stub at ``stub`` embeds Python ``version``."""
    try:
        built_for = stub_python_version(stub)
    except (OSError, ValueError) as e:
        raise PackError(f"cannot tell which Python the stub {stub} embeds: {e}") from e
    if built_for != version:
        raise PackError(
            f"the stub {stub} embeds Python {built_for} but this interpreter is Python {version}: pack the "
            f"environment with a Python {built_for} interpreter (in the tritonserver image, its own python3), or "
            f"give the models a stub built for {version}"
        )


def installed_distribution(name: str) -> metadata.Distribution:
    """The distribution ``name`` as installed in this interpreter's site-packages, before any other copy of its
    metadata on sys.path (a stale NAME.egg-info that an old build left in the current directory comes first)."""
    candidates = list(metadata.distributions(name=name))
    if not candidates:
        raise metadata.PackageNotFoundError(name)
    site_dirs = {Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")}
    installed = [d for d in candidates if Path(d.locate_file("")).resolve() in site_dirs]
    return (installed or candidates)[0]


def _own_requirements() -> list[str]:
    try:
        return installed_distribution(PACKAGE).requires or []
    except metadata.PackageNotFoundError as e:
        raise PackError(f"{PACKAGE} is not installed in this interpreter ({sys.executable}): pip install it first"
                        ) from e


def requirement_closure(requirements: tuple[str, ...] | list[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution that ``requirements`` need, transitively (markers evaluated for this
    interpreter, requested extras followed, none at the top), by canonical name. PackError names a required
    distribution that is not installed."""
    found: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    pending = [(Requirement(r), PACKAGE) for r in requirements]
    pending = [(r, by) for r, by in pending if _applies(r, set())]
    while pending:
        requirement, wanted_by = pending.pop()
        name = canonicalize_name(requirement.name)
        new_extras = set(requirement.extras) - extras_seen.get(name, set())
        if name == PACKAGE or (name in found and not new_extras):
            continue
        try:
            dist = found.get(name) or installed_distribution(requirement.name)
        except metadata.PackageNotFoundError as e:
            raise PackError(f"{requirement.name} (needed by {wanted_by}) is not installed in this interpreter "
                            f"({sys.executable}): pip install '{requirement}'") from e
        found[name] = dist
        extras_seen.setdefault(name, set()).update(requirement.extras)
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if _applies(sub, extras_seen[name]):
                pending.append((sub, dist.metadata["Name"]))
    return found


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether ``requirement`` holds here for a distribution installed with ``extras`` (none: only unconditional
    and platform markers)."""
    if requirement.marker is None:
        return True
    environment = default_environment()
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in ("", *sorted(extras)))


def _refuse_to_replace(out: Path, archive: bool) -> None:
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        return
    if archive and out.is_file():
        out.unlink()
        return
    if not archive and out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file()):
        shutil.rmtree(out)
        return
    raise FileExistsError(f"{out} exists and is not a packed environment: refusing to replace it")


def _build(env: Path, version: str, distributions: dict[str, metadata.Distribution], link: str,
           imports: tuple[str, ...]) -> None:
    place = _linker(link)
    env.mkdir(parents=True)
    python = f"python{version}"
    (env / "bin").mkdir()
    shutil.copy2(_interpreter(), env / "bin" / python)
    for alias in ("python3", "python"):
        (env / "bin" / alias).symlink_to(python)
    (env / "bin" / "activate").write_text(ACTIVATE)
    (env / "lib").mkdir()
    libpython = _libpython(version)
    place(libpython, env / "lib" / libpython.name)
    stdlib = Path(sysconfig.get_path("stdlib"))
    target = env / "lib" / python
    target.mkdir()
    for entry in sorted(stdlib.iterdir()):
        if entry.name not in STDLIB_LEFT_OUT and not _CONFIG_DIR.fullmatch(entry.name):
            place(entry, target / entry.name)
    dynload = Path(sysconfig.get_config_var("DESTSHARED") or stdlib / "lib-dynload")
    if not (target / "lib-dynload").exists() and dynload.is_dir():
        place(dynload, target / "lib-dynload")
    headers = Path(sysconfig.get_path("include"))
    if (headers / "Python.h").is_file():
        (env / "include").mkdir()
        place(headers, env / "include" / python)
    site = env / _site_packages_in(env)
    site.mkdir(parents=True, exist_ok=True)
    packed = {PACKAGE: _place_own_package(site, place)}
    for name, dist in sorted(distributions.items()):
        _place_distribution(dist, site, place)
        packed[name] = dist.version
    (env / MANIFEST).write_text(json.dumps({
        "python": version,
        "site_packages": str(site.relative_to(env)),
        "link": link,
        "distributions": packed,
    }, indent=1) + "\n")
    verify_environment(env, imports)


def _linker(link: str):
    def copy(source: Path, target: Path) -> None:
        if source.is_dir():
            shutil.copytree(source, target, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)

    def symlink(source: Path, target: Path) -> None:
        target.symlink_to(source.resolve())

    return copy if link == "copy" else symlink


def _interpreter() -> Path:
    """The real binary of this Python (a venv's python is a link to it)."""
    executable = Path(getattr(sys, "_base_executable", "") or sys.executable).resolve()
    if not executable.is_file():
        raise PackError(f"cannot find this interpreter's binary ({executable})")
    return executable


def _libpython(version: str) -> Path:
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    path = Path(libdir or "", soname or "")
    if not soname or not soname.startswith(f"libpython{version}.so") or not path.is_file():
        raise PackError(f"no libpython{version}.so next to this interpreter (LIBDIR {libdir}, INSTSONAME {soname}): "
                        "the stub embeds it; use a Python built with --enable-shared or install libpython"
                        f"{version} (Debian, Ubuntu: apt-get install libpython{version})")
    return path


def _site_packages_in(env: Path) -> Path:
    """Where this interpreter, installed at ``env``, looks for packages (Debian's Python: dist-packages), relative
    to ``env``. Asked of the interpreter itself, outside any virtual environment."""
    code = "import site, sys; print(site.getsitepackages([sys.argv[1]])[0])"
    done = subprocess.run([str(_interpreter()), "-I", "-c", code, str(env)], capture_output=True, text=True,
                          check=False, env={"PATH": os.defpath})
    if done.returncode != 0:
        raise PackError(f"{_interpreter()} could not name its site-packages directory: {done.stderr.strip()}")
    return Path(done.stdout.strip()).relative_to(env)


def _place_own_package(site: Path, place) -> str:
    """manylora itself, from wherever it is imported (an editable install points into its source tree)."""
    import manylora

    dist = installed_distribution(PACKAGE)
    place(Path(manylora.__file__).resolve().parent, site / PACKAGE)
    info = site / f"{PACKAGE}-{dist.version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(dist.read_text("METADATA") or f"Metadata-Version: 2.1\nName: {PACKAGE}\n")
    (info / "top_level.txt").write_text(f"{PACKAGE}\n")
    (info / "INSTALLER").write_text("manylora-deploy\n")
    (info / "RECORD").write_text("")
    return dist.version


def _place_distribution(dist: metadata.Distribution, site: Path, place) -> None:
    """The distribution's installed files (from its RECORD), at the same places under ``site``."""
    name = dist.metadata["Name"]
    if _is_editable(dist):
        raise PackError(f"{name} is installed in editable mode (its files are a source tree): install it normally "
                        "to pack it")
    root = Path(dist.locate_file("")).resolve()
    if not dist.files:
        raise PackError(f"{name} {dist.version} lists no files (no RECORD): reinstall it with pip")
    for file in dist.files:
        source = Path(dist.locate_file(file))
        relative = Path(os.path.normpath(root / file)).relative_to(root) if not str(file).startswith("..") else None
        if relative is None or "__pycache__" in relative.parts:
            continue  # scripts outside site-packages (bin/), compiled bytecode
        if not source.exists():
            raise PackError(f"{source}: a file of {name} {dist.version} is missing; reinstall it")
        target = site / relative
        if target.exists() or target.is_symlink():
            continue  # a namespace package's file that another distribution placed
        target.parent.mkdir(parents=True, exist_ok=True)
        place(source, target)


def _is_editable(dist: metadata.Distribution) -> bool:
    direct = dist.read_text("direct_url.json")
    if not direct:
        return False
    try:
        return bool(json.loads(direct).get("dir_info", {}).get("editable"))
    except ValueError:
        return False


def verify_environment(env: Path, imports: tuple[str, ...]) -> None:
    """Start the environment's python as the stub's starts (PATH and LD_LIBRARY_PATH of bin/activate, nothing else
    of this process's environment): PackError unless its prefix is ``env``, it searches nothing outside it, and
    it imports every module of ``imports`` from inside it."""
    code = (
        "import importlib, json, sys\n"
        "files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}\n"
        "print(json.dumps({'prefix': sys.prefix, 'path': sys.path, 'files': files}))\n"
    )
    script = f'source "{env}/bin/activate" && exec python3 -c "$0" "$@"'
    done = subprocess.run(["bash", "-c", script, code, *imports], capture_output=True, text=True, check=False, cwd=env,
                          env={"PATH": os.defpath, "HOME": os.environ.get("HOME", "/")})
    if done.returncode != 0:
        raise PackError(f"the packed environment {env} does not import {list(imports)}: {done.stderr.strip()[-3000:]}")
    report = json.loads(done.stdout)
    prefix = report["prefix"]
    if os.path.realpath(prefix) != os.path.realpath(env):
        raise PackError(f"the packed environment's python took {prefix} as its prefix, not {env}")
    outside = [p for p in report["path"] if p and not p.startswith(prefix + os.sep)]
    outside += [f for f in report["files"].values() if not f.startswith(prefix + os.sep)]
    if outside:
        raise PackError(f"the packed environment's python reaches outside it: {outside}")


def _archive(env: Path, out: Path, compresslevel: int) -> None:
    """``env`` as a .tar.gz whose root is the environment (bin/activate at the top), links resolved to files."""
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:gz", compresslevel=compresslevel, dereference=True) as archive:
        for entry in sorted(env.iterdir()):
            archive.add(entry, arcname=entry.name, filter=_without_bytecode)
    partial.replace(out)


def _without_bytecode(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in Path(info.name).parts else info

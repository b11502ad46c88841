"""Start the real Triton server (2.51, from the nvidia-pytriton wheel) on the manylora repository.

Renders model_repository/ into --out with the parameters filled in (absolute paths, engine
knobs), makes the Python-backend stub and its libraries reachable, then execs tritonserver
listening on 127.0.0.1 (--address picks another: a deliberate choice). Triton's administrative
APIs (shared memory, model repository, model config, statistics, logging, trace) are restricted
to requests that carry the header ``manylora-admin-key`` with the operator's key (--admin-key,
$MANYLORA_ADMIN_KEY, else a random key kept in --admin-key-file); --open-apis opens some or all.
docs/security.md says what is exposed and why. The helpers are importable so the end-to-end
tests start the server exactly the same way:

    python scripts/serve.py --base-model build/default/base --adapters build/default/catalogue.json
    python scripts/serve.py --param max_loras=8 --param page_size=32 --http-port 9000
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import socket
import sys
import sysconfig
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# config.pbtxt parameters of the generator other than the checkpoint and the catalogue
ENGINE_PARAMS = (
    "device",
    "dtype",
    "max_lora_rank",
    "max_loras",
    "max_cpu_loras",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "page_size",
    "num_kv_pages",
    "gpu_memory_fraction",
    "max_queue_size",
    "tensor_parallel_size",
    "stream_interval_ms",
)
# config.pbtxt parameters of the generator model file itself, not EngineConfig fields
MODEL_PARAMS = ("metrics_adapter_labels",)
PLACEHOLDER = re.compile(r"\$\{([a-z_]+)\}")
# Triton's APIs that no tenant needs: registering shared-memory regions (the Python backend's own among them),
# loading and unloading models, configs (they hold server paths), per-model statistics, log and trace settings
ADMIN_APIS = ("shared-memory", "model-repository", "model-config", "statistics", "logging", "trace")
ADMIN_HEADER = "manylora-admin-key"


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def triton_home() -> Path:
    """pytriton/tritonserver inside the running interpreter's site-packages."""
    home = site_packages() / "pytriton" / "tritonserver"
    if not (home / "bin" / "tritonserver").is_file():
        raise FileNotFoundError(
            f"{home}/bin/tritonserver not found: install the server with `pip install --no-deps nvidia-pytriton==0.7.0`"
        )
    return home


def install_stub(home: Path | None = None) -> Path:
    """Put the running Python's triton_python_backend_stub into backends/python/.

    A stub already there may be another Python's (a server tree copied from another machine
    was seen carrying a 3.11 stub to a 3.12 host: "libpython3.11.so.1.0: cannot open"), so it
    is replaced unless it is byte-identical to the right one.
    """
    home = home or triton_home()
    target = home / "backends" / "python" / "triton_python_backend_stub"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no Python-backend stub for Python {version} in the pytriton wheel")
    if not target.is_file() or target.read_bytes() != source.read_bytes():
        shutil.copy2(source, target)
    return target


def check_engine_params(params: dict[str, str]) -> None:
    known = set(ENGINE_PARAMS) | set(MODEL_PARAMS)
    try:  # the engine's own list, where it is importable
        from manylora.engine.config import EngineConfig

        known |= {f.name for f in fields(EngineConfig)} - {"model_dir", "adapters"}
    except ImportError:
        pass
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(known)}")


def render_repository(
    base_model: str | Path,
    adapters: str | Path | None,
    out: str | Path,
    params: dict[str, str] | None = None,
    source: str | Path = REPO / "model_repository",
) -> Path:
    """Copy ``source`` to ``out`` (replacing it) with every ${...} placeholder filled in."""
    params = dict(params or {})
    check_engine_params(params)
    base_model = Path(base_model).resolve()
    if not (base_model / "config.json").is_file():
        raise FileNotFoundError(f"{base_model}/config.json not found: --base-model must be a checkpoint dir")
    values = {name: "" for name in (*ENGINE_PARAMS, *MODEL_PARAMS)}
    values.update(params)
    values["base_model"] = str(base_model)
    values["tokenizer_dir"] = str(base_model)
    if adapters:
        adapters = Path(adapters).resolve()
        if not adapters.is_file():
            raise FileNotFoundError(f"{adapters}: adapter catalogue not found")
        values["adapters"] = str(adapters)
    else:
        values["adapters"] = ""
    source, out = Path(source).resolve(), Path(out).resolve()
    if out == source:
        raise ValueError("--out must differ from the source model repository")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".gitkeep"))
    for config in out.glob("*/config.pbtxt"):
        text = config.read_text()
        missing = sorted(set(PLACEHOLDER.findall(text)) - set(values))
        if missing:
            raise ValueError(f"{config}: no value for {missing}")
        if config.parent.name == "generator":  # engine knobs the template does not list yet
            for key in sorted(set(params) - set(PLACEHOLDER.findall(text))):
                text += f'parameters {{ key: "{key}" value: {{ string_value: "${{{key}}}" }} }}\n'
        config.write_text(PLACEHOLDER.sub(lambda m: values[m.group(1)].replace('"', '\\"'), text))
    # an empty version directory (the ensemble's) must exist; git does not keep empty dirs
    for model in out.iterdir():
        if (model / "config.pbtxt").is_file():
            (model / "1").mkdir(exist_ok=True)
    return out


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: the stub's libraries, this venv's python3 first on PATH.

    The stub's interpreter ignores PYTHONPATH: the models find manylora/engine/ through the venv
    (the repository is pip-installed there, editable).
    """
    env = dict(os.environ if base is None else base)
    libs = [str(site_packages() / "nvidia_pytriton.libs")]
    # The stub links libpython3.X.so.1.0: load the running interpreter's own, or a system
    # libpython of another patch release meets this interpreter's extension modules
    # (seen: "_ssl...so: undefined symbol: _PyModule_Add" with pyenv 3.11.7 over Debian's 3.11.2).
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        libs.insert(0, libdir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*libs, env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    return env


def admin_key(given: str | None, key_file: str | Path) -> str:
    """The operator's admin key: given, else the one kept in ``key_file`` (made with a random key, mode 0600,
    when missing)."""
    if given:
        return given
    path = Path(key_file)
    if path.is_file():
        key = path.read_text().strip()
        if key:
            return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key


def restriction_flags(key: str, open_apis: tuple[str, ...] = ()) -> list[str]:
    """tritonserver flags that restrict ADMIN_APIS (less ``open_apis``) to requests with the admin key header."""
    unknown = sorted(set(open_apis) - set(ADMIN_APIS) - {"all"})
    if unknown:
        raise ValueError(f"--open-apis: unknown API(s) {unknown}; restricted ones are {', '.join(ADMIN_APIS)} (or all)")
    if "all" in open_apis:
        return []
    restricted = ",".join(api for api in ADMIN_APIS if api not in open_apis)
    if not restricted:
        return []
    if not re.fullmatch(r"[A-Za-z0-9._~-]+", key):
        raise ValueError("the admin key may hold only letters, digits and ._~- (it travels in a header)")
    return [f"--http-restricted-api={restricted}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={restricted}:{ADMIN_HEADER}={key}"]


def server_command(
    repository: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    address: str = "127.0.0.1",
    extra: list[str] | None = None,
    restrictions: list[str] | None = None,
) -> list[str]:
    """The tritonserver command line; ``restrictions`` are restriction_flags() (none: every API open)."""
    home = triton_home()
    return [
        str(home / "bin" / "tritonserver"),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={home / 'backends'}",
        f"--http-address={address}",
        f"--http-port={http_port}",
        f"--grpc-address={address}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={address}",
        f"--metrics-port={metrics_port}",
        "--backend-config=python,shm-default-byte-size=4194304",
        "--backend-config=python,shm-growth-byte-size=1048576",
        *(restrictions or []),
        *(extra or []),
    ]


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """``n`` ports free on ``address`` now (for servers started side by side: tests, benchmarks)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((address, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param wants key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default="build/default/base", help="HF checkpoint dir (with tokenizer.json)")
    ap.add_argument("--adapters", default="build/default/catalogue.json", help="catalogue JSON {name: adapter dir}")
    ap.add_argument("--model-repository", default=str(REPO / "model_repository"), help="repository to render")
    ap.add_argument("--out", default="build/model_repository", help="where the rendered repository goes")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--address", default="127.0.0.1",
                    help="address to listen on (loopback by default; 0.0.0.0 for every interface)")
    ap.add_argument("--admin-key", default=os.environ.get("MANYLORA_ADMIN_KEY"),
                    help=f"value of the {ADMIN_HEADER} header that opens the restricted APIs "
                         "(default: $MANYLORA_ADMIN_KEY, else the key in --admin-key-file)")
    ap.add_argument("--admin-key-file", default="build/admin-key",
                    help="where the admin key is kept when none is given (made, mode 0600, if missing)")
    ap.add_argument("--open-apis", default="",
                    help=f"comma-separated APIs to leave open to everyone, of {', '.join(ADMIN_APIS)}; or 'all'")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="engine parameter (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="render and print the command, do not start")
    args, extra = ap.parse_known_args(argv)
    try:
        params = {k: v for k, v in parse_params(args.param).items() if v != ""}
        repo = render_repository(args.base_model, args.adapters or None, args.out, params, args.model_repository)
        install_stub()
        open_apis = tuple(api.strip() for api in args.open_apis.split(",") if api.strip())
        restrictions = restriction_flags(admin_key(args.admin_key, args.admin_key_file), open_apis)
        cmd = server_command(repo, args.http_port, args.grpc_port, args.metrics_port, args.address, extra,
                             restrictions)
    except (FileNotFoundError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    shown = [re.sub(f"{ADMIN_HEADER}=.*", f"{ADMIN_HEADER}=<key>", part) for part in cmd]
    print(" ".join(shown), file=sys.stderr, flush=True)
    if restrictions:
        where = "--admin-key" if args.admin_key else args.admin_key_file
        print(f"serve: {', '.join(a for a in ADMIN_APIS if a not in open_apis)} need the header "
              f"'{ADMIN_HEADER}' (its value: {where})", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    os.execve(cmd[0], cmd, server_env())
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())

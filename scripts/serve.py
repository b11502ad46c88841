"""Start the real Triton server (2.51, from the nvidia-pytriton wheel) on the manylora repository.

Renders model_repository/ into --out with the parameters filled in (absolute paths, engine
knobs), makes the Python-backend stub and its libraries reachable, then runs tritonserver
listening on 127.0.0.1 (--address picks another: a deliberate choice) until it stops; one still there
10 s after its exit timeout from SIGINT / SIGTERM is killed (manylora.deploy.supervisor), and the shared-memory
regions a killed server leaves are removed after it (their names carry a prefix of this server's own). Triton's
administrative APIs (shared memory, model repository, model config, statistics, logging, trace) are
restricted to requests that carry the header ``manylora-admin-key`` with the operator's key (--admin-key,
$MANYLORA_ADMIN_KEY, else a random key kept in --admin-key-file); --open-apis opens some or all.
docs/security.md says what is exposed and why. The helpers are importable so the end-to-end
tests start the server exactly the same way:

    python scripts/serve.py --base-model build/default/base --adapters build/default/catalogue.json
    python scripts/serve.py --param max_loras=8 --param page_size=32 --http-port 9000
    python scripts/serve.py --openai-port 9000     # and the OpenAI-compatible front beside it (docs/openai.md)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

from manylora.deploy.operator_key import operator_key
from manylora.deploy.repository import ENGINE_PARAMS, MODEL_PARAMS, RenderSpec, check_engine_params, parse_params
from manylora.deploy.repository import render_repository as render
from manylora.deploy.server_flags import ADMIN_APIS, ADMIN_HEADER, PYTHON_BACKEND_FLAGS, listen_flags, restriction_flags
from manylora.deploy.shm_regions import new_prefix, prefix_flag
from manylora.deploy.supervisor import supervise

REPO = Path(__file__).resolve().parent.parent
# the rendering and the server flags are manylora.deploy's (python -m manylora.deploy render serves a fleet's own
# tritonserver); these names stay importable from here
__all__ = ["ADMIN_APIS", "ADMIN_HEADER", "ENGINE_PARAMS", "MODEL_PARAMS", "check_engine_params", "parse_params",
           "render_repository", "restriction_flags"]


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


def render_repository(
    base_model: str | Path,
    adapters: str | Path | None,
    out: str | Path,
    params: dict[str, str] | None = None,
    source: str | Path | None = None,
    environment: str | Path | None = None,
) -> Path:
    """The repository in ``out`` (replacing a rendered one), rendered by manylora.deploy: absolute paths."""
    return render(RenderSpec(base_model=Path(base_model), out=Path(out), adapters=Path(adapters) if adapters else None,
                             params=dict(params or {}), environment=Path(environment) if environment else None,
                             source=Path(source) if source else None))


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


def server_command(
    repository: str | Path,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    address: str = "127.0.0.1",
    extra: list[str] | None = None,
    restrictions: list[str] | None = None,
    shm_prefix: str | None = None,
) -> list[str]:
    """The tritonserver command line; ``restrictions`` are restriction_flags() (none: every API open). The
    Python backend's regions are named with ``shm_prefix`` (a new one when None), so that those a killed server
    leaves can be told from another server's and removed (manylora.deploy.shm_regions)."""
    home = triton_home()
    return [
        str(home / "bin" / "tritonserver"),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={home / 'backends'}",
        *listen_flags(address, http_port, grpc_port, metrics_port),
        *PYTHON_BACKEND_FLAGS,
        prefix_flag(shm_prefix or new_prefix()),
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


def openai_command(grpc_port: int, port: int, address: str = "127.0.0.1") -> list[str]:
    """The OpenAI-compatible front's command line: on ``address``:``port``, talking to this server's gRPC port."""
    triton = "127.0.0.1" if address in ("0.0.0.0", "::", "") else address
    return [sys.executable, "-m", "manylora.openai", "--triton-grpc", f"{triton}:{grpc_port}", "--host", address,
            "--port", str(port)]


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
    ap.add_argument("--openai-port", type=int, default=0,
                    help="also start the OpenAI-compatible front (python -m manylora.openai) on this port, stopped "
                         "with the server (0: not)")
    ap.add_argument("--dry-run", action="store_true", help="render and print the command, do not start")
    args, extra = ap.parse_known_args(argv)
    try:
        params = {k: v for k, v in parse_params(args.param).items() if v != ""}
        repo = render_repository(args.base_model, args.adapters or None, args.out, params, args.model_repository)
        install_stub()
        open_apis = tuple(api.strip() for api in args.open_apis.split(",") if api.strip())
        restrictions = restriction_flags(operator_key(args.admin_key, args.admin_key_file), open_apis)
        cmd = server_command(repo, args.http_port, args.grpc_port, args.metrics_port, args.address, extra,
                             restrictions)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2
    shown = [re.sub(f"{ADMIN_HEADER}=.*", f"{ADMIN_HEADER}=<key>", part) for part in cmd]
    print(" ".join(shown), file=sys.stderr, flush=True)
    if restrictions:
        where = "--admin-key" if args.admin_key else args.admin_key_file
        print(f"serve: {', '.join(a for a in ADMIN_APIS if a not in open_apis)} need the header "
              f"'{ADMIN_HEADER}' (its value: {where})", file=sys.stderr, flush=True)
    front = openai_command(args.grpc_port, args.openai_port, args.address) if args.openai_port else None
    if front:
        print(" ".join(front), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return supervise(cmd, server_env(), front)


if __name__ == "__main__":
    sys.exit(main())

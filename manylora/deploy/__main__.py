"""python -m manylora.deploy render|pack-env (console script: manylora-deploy).

    render     write the model repository with its parameters filled in, for a tritonserver started with its
               own flags (printed at the end)
    pack-env   pack the Python environment the models run in (EXECUTION_ENV_PATH), as a directory or a .tar.gz

    python -m manylora.deploy pack-env --out /srv/manylora/env
    python -m manylora.deploy render --out /srv/manylora/repository --env /srv/manylora/env \\
        --base-model /srv/models/llama --adapters /srv/models/catalogue.json --relative-paths --param max_loras=32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from manylora.deploy.packed_env import LINK_MODES, PackError, PackSpec, pack_environment
from manylora.deploy.repository import RenderSpec, parse_params, render_repository
from manylora.deploy.server_flags import ADMIN_APIS, ADMIN_HEADER, PYTHON_BACKEND_FLAGS


def server_command_hint(repository: Path) -> str:
    """The tritonserver command line a rendered repository wants (the admin key is the operator's)."""
    restricted = ",".join(ADMIN_APIS)
    return " \\\n    ".join([
        f"tritonserver --model-repository={repository}",
        *PYTHON_BACKEND_FLAGS,
        f"--http-restricted-api={restricted}:{ADMIN_HEADER}=$MANYLORA_ADMIN_KEY",
        f"--grpc-restricted-protocol={restricted}:{ADMIN_HEADER}=$MANYLORA_ADMIN_KEY",
    ])


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``render`` and ``pack-env``."""
    ap = argparse.ArgumentParser(prog="python -m manylora.deploy", description=__doc__.splitlines()[0])
    commands = ap.add_subparsers(dest="command", required=True)

    render = commands.add_parser("render", help="write the model repository")
    render.add_argument("--out", required=True, help="the repository to write (a rendered one there is replaced)")
    render.add_argument("--base-model", required=True, help="Hugging Face checkpoint directory (with tokenizer.json)")
    render.add_argument("--adapters", default=None, help="adapter catalogue JSON {name: adapter dir}")
    render.add_argument("--env", default=None,
                        help="packed environment (directory or .tar.gz) named by EXECUTION_ENV_PATH in every Python "
                             "model; none: the models run in the Python the server's stub finds itself")
    render.add_argument("--relative-paths", action="store_true",
                        help="write the checkpoint, catalogue and environment relative to the model directories "
                             "($$TRITON_MODEL_DIRECTORY/..), so that they move together")
    render.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="engine knob or model parameter (repeatable; docs/configuration.md)")
    render.add_argument("--template", default=None, help="template repository (default: the packaged one)")

    pack = commands.add_parser("pack-env", help="pack the models' Python environment")
    pack.add_argument("--out", required=True, help="a directory, or a file name ending in .tar.gz")
    pack.add_argument("--link", choices=LINK_MODES, default="copy",
                      help="directory only: copy the files (default; self-contained) or symlink them into this "
                           "installation (fast; for this machine only)")
    pack.add_argument("--stub", default=None,
                      help="the server's triton_python_backend_stub: its Python must be this interpreter's "
                           "(default: the NGC image's, where it exists)")
    pack.add_argument("--compresslevel", type=int, default=4, help=".tar.gz only: gzip level, 1-9")

    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "render":
            out = render_repository(RenderSpec(
                base_model=Path(args.base_model),
                out=Path(args.out),
                adapters=Path(args.adapters) if args.adapters else None,
                params=parse_params(args.param),
                environment=Path(args.env) if args.env else None,
                relative_paths=args.relative_paths,
                source=Path(args.template) if args.template else None,
            ))
            print(f"rendered {out}; start the server with (docs/deployment.md):\n{server_command_hint(out)}")
        else:
            out = pack_environment(PackSpec(out=Path(args.out), link=args.link,
                                            stub=Path(args.stub) if args.stub else None,
                                            compresslevel=args.compresslevel))
            print(f"packed {out}")
    except (FileNotFoundError, FileExistsError, ValueError, PackError) as e:
        print(f"manylora.deploy {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

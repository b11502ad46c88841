"""Command line: generate (streamed), list adapters, engine stats, against a running server.

python -m manylora.client generate --adapter shout "In the morning the baker"
python -m manylora.client generate --no-stream --max-tokens 40 "In the morning the baker"
python -m manylora.client adapters list [--full]
python -m manylora.client adapters load NAME PATH [--sha256 HEX] [--replace]   (server:
MANYLORA_ALLOW_RUNTIME_ADAPTERS=1)
python -m manylora.client adapters unload NAME
python -m manylora.client stats
python -m manylora.client plan --base-model DIR --gpu-memory 141GiB --ranks 8:500,16:300,64:20 [--json]   (offline)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from manylora.client import plan
from manylora.client.api import ManyLoraClient, ManyLoraError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m manylora.client", description="manylora client")
    ap.add_argument("--url", default="localhost:8001", help="gRPC endpoint host:port (default %(default)s)")
    ap.add_argument("--http-url", default="localhost:8000", help="HTTP endpoint host:port (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt, streaming the text as it arrives")
    gen.add_argument("prompt")
    gen.add_argument("--adapter", "--lora", default=None, help="adapter name (default: the base model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="0: greedy (the default)")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--no-stream", action="store_true", help="one HTTP /generate call instead of gRPC streaming")

    adapters = sub.add_parser("adapters", help="adapters of the running server")
    adapters_sub = adapters.add_subparsers(dest="adapters_command", required=True)
    listing = adapters_sub.add_parser("list", help="name, rank, target modules, sha256")
    listing.add_argument("--full", action="store_true", help="print the whole sha256")
    listing.add_argument("--json", action="store_true", help="print JSON")
    load = adapters_sub.add_parser("load", help="register an adapter while serving (or re-version it: --replace)")
    load.add_argument("name")
    load.add_argument("path", help="PEFT adapter directory on the server's machine (made absolute if it exists here)")
    load.add_argument("--sha256", default=None, help="refuse unless the weights have this sha256")
    load.add_argument("--replace", action="store_true", help="re-version a registered adapter")
    unload = adapters_sub.add_parser("unload", help="unregister an adapter; admitted requests finish")
    unload.add_argument("name")

    sub.add_parser("stats", help="the engine's counters (JSON)")
    planner = sub.add_parser("plan", help="capacity plan for a base model and a rank mix (offline, no server)")
    plan.add_arguments(planner)
    return ap


def format_adapters(adapters: list[dict], full: bool = False) -> str:
    """A table of the server's adapters; a refused one shows its reason in place of its weights' hash."""
    rows = [("NAME", "STATUS", "RANK", "TARGET MODULES", "SHA256 / REASON")]
    for a in adapters:
        sha = a.get("sha256", "") if full else a.get("sha256", "")[:12]
        last = a.get("reason", "") if a.get("status") == "refused" else sha
        rows.append((a["name"], a.get("status", "ready"), str(a.get("rank", "")),
                     ",".join(a.get("target_modules", [])), last))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)) + "  " + row[4]
        for row in rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plan":
        try:
            return plan.run(args)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    client = ManyLoraClient(grpc_url=args.url, http_url=args.http_url, timeout=args.timeout)
    try:
        if args.command == "generate":
            sampling = {
                "adapter": args.adapter,
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "top_k": args.top_k,
                "top_p": args.top_p,
                "seed": args.seed,
                "stop": args.stop,
            }
            if args.no_stream:
                print(client.generate(args.prompt, **sampling))
            else:
                for piece in client.stream(args.prompt, **sampling):
                    print(piece, end="", flush=True)
                print()
        elif args.command == "adapters" and args.adapters_command == "load":
            path = Path(args.path)
            if not path.is_absolute() and path.exists():  # the server's working directory is not ours
                path = path.resolve()
            info = client.load_adapter(args.name, str(path), sha256=args.sha256, replace=args.replace)
            print(json.dumps(info, indent=2))
        elif args.command == "adapters" and args.adapters_command == "unload":
            print(json.dumps(client.unload_adapter(args.name), indent=2))
        elif args.command == "adapters":
            adapters = client.list_adapters()
            print(json.dumps(adapters, indent=2) if args.json else format_adapters(adapters, args.full))
        elif args.command == "stats":
            print(json.dumps(client.stats(), indent=2))
    except ManyLoraError as e:
        print(f"error: {e.message}" + (f" ({e.status})" if e.status else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0

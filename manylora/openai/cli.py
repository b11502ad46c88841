"""``python -m manylora.openai``: the OpenAI-compatible front beside a running Triton server.

    python -m manylora.openai --triton-grpc 127.0.0.1:8001 --port 9000
    python -m manylora.openai --triton-grpc triton:8001 --host 0.0.0.0 --served-model-name llama-3-8b \\
        --allow-adapter-management --admin-key "$KEY"
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from manylora.openai.config import DEFAULT_PORT, FrontConfig


def parse_args(argv: list[str] | None = None) -> tuple[FrontConfig, str]:
    """(the front's config, uvicorn's log level) from the command line."""
    ap = argparse.ArgumentParser(prog="python -m manylora.openai", description=__doc__.splitlines()[0])
    ap.add_argument("--triton-grpc", default=os.environ.get("MANYLORA_GRPC_URL", "127.0.0.1:8001"),
                    help="host:port of the Triton server's gRPC endpoint (default: $MANYLORA_GRPC_URL or "
                         "127.0.0.1:8001)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--served-model-name", help="the base model's name in 'model' (default: the checkpoint "
                                                "directory's name, as the server reports it)")
    ap.add_argument("--lora-separator", default=":", help="'model' may be <base><separator><adapter> too")
    ap.add_argument("--chat-template", type=Path,
                    help="a Jinja chat template file to use instead of the checkpoint's")
    ap.add_argument("--default-max-tokens", type=int, default=16,
                    help="max_tokens of a completion that gives none (chat: the context left)")
    ap.add_argument("--allow-adapter-management", action="store_true",
                    help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter to holders of the operator key "
                         "(the server must also run with MANYLORA_ALLOW_RUNTIME_ADAPTERS=1)")
    ap.add_argument("--admin-key", help="the operator key (default: $MANYLORA_OPENAI_ADMIN_KEY, else the key in "
                                        "--admin-key-file)")
    ap.add_argument("--admin-key-file", default="build/openai-admin-key",
                    help="where the operator key is kept when none is given (made, mode 0600, if missing)")
    ap.add_argument("--stats-interval", type=float, default=0.1,
                    help="seconds: /metrics asks the server for the engine's state at most this often")
    ap.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies are refused (413)")
    ap.add_argument("--request-timeout", type=float, help="seconds after which a generation is cancelled")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = ap.parse_args(argv)
    chat_template = args.chat_template.read_text(encoding="utf-8") if args.chat_template else None
    key = None
    if args.allow_adapter_management:
        from manylora.openai.admin import operator_key

        key = operator_key(args.admin_key, args.admin_key_file)
    config = FrontConfig(
        triton_url=args.triton_grpc, host=args.host, port=args.port, served_model_name=args.served_model_name,
        separator=args.lora_separator, chat_template=chat_template, default_max_tokens=args.default_max_tokens,
        allow_adapter_management=args.allow_adapter_management, admin_key=key,
        stats_interval_s=args.stats_interval, max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout,
    )
    return config, args.log_level


def main(argv: list[str] | None = None) -> int:
    try:
        config, log_level = parse_args(argv)
    except (OSError, ValueError) as e:
        print(f"manylora.openai: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from manylora.openai.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"manylora.openai: http://{config.host}:{config.port}/v1 -> Triton gRPC {config.triton_url}",
          file=sys.stderr, flush=True)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level=log_level,
                access_log=log_level == "debug", timeout_graceful_shutdown=5)
    return 0

"""The front's settings (one frozen dataclass, filled from the command line by cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 9000


@dataclass(frozen=True)
class FrontConfig:
    """How the OpenAI-compatible front reaches the Triton server and what it serves.

    Attributes:
        triton_url: host:port of the Triton server's gRPC endpoint.
        host, port: where the front listens (loopback by default, as the Triton server does).
        served_model_name: the base model's name in ``model``; None: the name the server reports (its checkpoint
            directory's name).
        separator: ``model`` may also be ``<base><separator><adapter>`` (vLLM's Triton frontend's --lora-separator).
        chat_template: a Jinja chat template's text that replaces the checkpoint's; None: the checkpoint's own.
        default_max_tokens: max_tokens of a completion that gives none (OpenAI's default, 16). A chat that gives none
            may use the context left after its prompt, reckoned from the prompt's UTF-8 bytes (each token is at least
            a byte), so a long prompt without max_tokens gets less than the whole rest.
        allow_adapter_management: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 404).
        admin_key: the operator key those two endpoints require (header ``manylora-admin-key`` or
            ``Authorization: Bearer``); None only while management is off.
        stats_interval_s: /metrics asks the server for the engine's state at most this often (scrapes in between get
            the last answer); a router scraping every 50 ms then costs the engine this many calls, not 20 a second.
        max_request_bytes: request bodies above this are refused (413) before they are parsed.
        request_timeout_s: a generation that has not finished after this long is cancelled (None: no limit).
        ready_timeout_s: how long a request waits for the Triton server to answer its first model_info while it
            starts (the front starts beside it).
    """

    triton_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    served_model_name: str | None = None
    separator: str = ":"
    chat_template: str | None = None
    default_max_tokens: int = 16
    allow_adapter_management: bool = False
    admin_key: str | None = None
    stats_interval_s: float = 0.1
    max_request_bytes: int = 4 << 20
    request_timeout_s: float | None = None
    ready_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.allow_adapter_management and not self.admin_key:
            raise ValueError("adapter management needs an operator key (admin_key)")
        if not self.separator:
            raise ValueError("separator must not be empty")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")

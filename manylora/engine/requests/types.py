"""What a caller hands the engine and what it gets back, one request at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from manylora.engine.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy (top_k/top_p unused)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None  # None: a seed drawn by the engine
    stop: tuple[str, ...] = ()  # output ends before the first occurrence; not included
    ignore_eos: bool = False


@dataclass
class GenerationRequest:
    """One generation: prompt token ids, the adapter that serves it, how to decode."""

    request_id: str
    prompt_ids: list[int]
    adapter: str | None = None  # None or "": the base model alone
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True  # False: one output at the end, with every token
    is_cancelled: Callable[[], bool] | None = None  # polled by the engine between steps (CANCEL_POLL_S)
    # a heartbeat output (no tokens) whenever the request has had no output for this long: how a caller
    # that only learns of cancellation when it handles an output (Triton's ensemble) hears of it in time
    keepalive_s: float | None = None


@dataclass
class GenerationOutput:
    """A chunk of a request's output, handed to the request's emit callback.

    token_ids are the tokens released by this chunk; their text is
    ``decode(context_ids + token_ids)[len(decode(context_ids)):]`` with the last
    ``strip_chars`` characters removed (a stop string that ended inside a token).
    Chunk boundaries fall only where the text is complete (no UTF-8 character split),
    so concatenating the chunks' texts gives the text of all tokens at once.
    """

    request_id: str
    token_ids: list[int]
    context_ids: list[int]
    strip_chars: int = 0
    finished: bool = False
    finish_reason: str | None = None  # "length" | "eos" | "stop" | "cancelled" | "error"
    error: RequestError | None = None
    adapter: str | None = None
    adapter_sha256: str | None = None  # the version of the adapter that served it
    heartbeat: bool = False  # no tokens: only says the request is still on (GenerationRequest.keepalive_s)
    prompt_tokens: int = 0  # the request's prompt length
    # output tokens this chunk accounts for: len(token_ids), and on the last chunk also the tokens a stop string cut
    # off, so a request's chunks add up to every token it generated (an EOS not counted)
    output_tokens: int = 0


EmitFn = Callable[[GenerationOutput], None]

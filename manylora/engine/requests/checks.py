"""What a request must satisfy whatever the engine's state: prompt, lengths, sampling parameters.

The engine adds the checks that depend on its state (adapter known, pages, queue room).
"""

from __future__ import annotations

import math

from manylora.engine.errors import ErrorCode, RequestError
from manylora.engine.requests.types import GenerationRequest


def check_request(request: GenerationRequest, vocab_size: int, max_len: int) -> None:
    """Raise RequestError (INVALID_ARG, naming the request and the limit) if the request is malformed."""
    p, rid = request.sampling, request.request_id
    n = len(request.prompt_ids)
    if n == 0:
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: empty prompt (no input tokens)")
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(ErrorCode.INVALID_ARG,
                           f"request {rid}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    if n >= max_len:
        raise RequestError(ErrorCode.INVALID_ARG,
                           f"request {rid}: prompt of {n} tokens does not fit the context of {max_len} tokens "
                           f"(max_model_len; at least one new token must fit)")
    if p.max_tokens <= 0:
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: max_tokens must be > 0, got {p.max_tokens}")
    if n + p.max_tokens > max_len:
        raise RequestError(ErrorCode.INVALID_ARG,
                           f"request {rid}: prompt of {n} tokens + max_tokens {p.max_tokens} exceeds the context "
                           f"of {max_len} tokens (max_model_len); ask for at most {max_len - n} tokens")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: temperature must be >= 0, got {p.temperature}")
    if p.top_k < 0:
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: top_k must be >= 0 (0: off), got {p.top_k}")
    if not (math.isfinite(p.top_p) and 0 < p.top_p <= 1):
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: top_p must be in (0, 1], got {p.top_p}")
    if p.seed is not None and not 0 <= p.seed < 2**64:
        raise RequestError(ErrorCode.INVALID_ARG, f"request {rid}: seed must be in [0, 2^64), got {p.seed}")

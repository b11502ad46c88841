"""One request inside the engine: its tokens, its KV pages, and what it has released."""

from __future__ import annotations

import itertools
import time
from enum import Enum

import torch

from manylora.engine.adapters.spec import AdapterSpec
from manylora.engine.requests.detokenize import CONTEXT_TOKENS, IncrementalDecoder
from manylora.engine.requests.types import EmitFn, GenerationOutput, GenerationRequest

_arrival = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's state. ``num_computed`` tokens of ``all_ids`` have their KV in the cache."""

    def __init__(self, request: GenerationRequest, emit: EmitFn, decoder: IncrementalDecoder,
                 generator: torch.Generator, eos_ids: frozenset[int], max_len: int,
                 spec: AdapterSpec | None, stream_interval_s: float = 0.0) -> None:
        self.request = request
        self.emit = emit
        self.decoder = decoder
        self.generator = generator
        self.eos_ids = eos_ids
        self.max_len = max_len
        self.spec = spec  # the adapter version admitted with; it serves the whole request
        self.adapter_sha256 = spec.sha256 if spec else None
        self.arrival = next(_arrival)
        self.prompt_ids = list(request.prompt_ids)
        self.output_ids: list[int] = []
        self.num_computed = 0
        self.status = Status.WAITING
        self.released = 0  # output tokens already sent
        self.stream_interval_s = stream_interval_s  # a streamed request's chunks are at least this far apart
        self.released_at = 0.0  # when the last chunk was released
        self.finish_reason: str | None = None
        self.stop_at_char: int | None = None  # where a matched stop string begins in the text
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.last_output_at = self.submitted_at  # last output or heartbeat handed to emit

    def time_per_output_token(self) -> float | None:
        """Mean seconds between this request's output tokens (None with fewer than two)."""
        n = len(self.output_ids)
        if n < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (n - 1)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> str | None:
        return self.request.adapter or None

    @property
    def keepalive_s(self) -> float | None:
        """The longest this request may go without a response (heartbeats.py); None: no heartbeats."""
        return self.request.keepalive_s

    @property
    def adapter_key(self) -> tuple[str, str] | None:
        """(name, sha256) of the adapter version serving this request; None for the base model."""
        return (self.spec.name, self.spec.sha256) if self.spec else None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    # ---------------------------------------------------------------- tokens in
    def append_token(self, token: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        params = self.request.sampling
        if token in self.eos_ids and not params.ignore_eos:
            self.finish_reason = "eos"
            return
        self.output_ids.append(token)
        self.decoder.append(token)
        if params.stop and self._find_stop():
            self.finish_reason = "stop"
        elif len(self.output_ids) >= params.max_tokens or self.num_tokens() >= self.max_len:
            self.finish_reason = "length"

    def _find_stop(self) -> bool:
        text = self.decoder.text
        hits = [i for s in self.request.sampling.stop if s and (i := text.find(s)) >= 0]
        if hits:
            self.stop_at_char = min(hits)
        return bool(hits)

    # -------------------------------------------------------------- tokens out
    def _holdback_for_stop(self, n: int) -> int:
        """Fewest tokens to keep back so that no released text could begin a stop string."""
        stops = [s for s in self.request.sampling.stop if s]
        while n > self.released:
            tail = self.decoder.text_of(n)
            if not any(tail.endswith(s[:j]) for s in stops for j in range(1, len(s))):
                break
            n -= 1
        return n

    def next_output(self) -> GenerationOutput | None:
        """The chunk to send now, or None when nothing can be released yet."""
        finished = self.finish_reason is not None
        if not finished and not self.request.stream:
            return None
        if not finished and self.released and time.perf_counter() - self.released_at < self.stream_interval_s:
            return None  # tokens gather until the interval is over: one response for several tokens
        strip = 0
        if finished:
            n = len(self.output_ids)
            if self.stop_at_char is not None:
                n = max(self._tokens_covering(self.stop_at_char), self.released)
                strip = max(0, len(self.decoder.text_of(n)) - self.stop_at_char)
        else:
            n = self.decoder.clean_prefix_len(self.released)
            if self.request.sampling.stop:
                n = self._holdback_for_stop(n)
            if n <= self.released:
                return None
        start = self.released if self.request.stream else 0
        generated = len(self.output_ids) if finished else n
        context = self.output_ids[max(0, start - CONTEXT_TOKENS):start]
        if start < CONTEXT_TOKENS:
            context = self.prompt_ids[-(CONTEXT_TOKENS - len(context)):] + context if self.prompt_ids else context
        chunk = GenerationOutput(
            request_id=self.request_id,
            token_ids=self.output_ids[start:n],
            context_ids=context,
            strip_chars=strip,
            finished=finished,
            finish_reason=self.finish_reason,
            adapter=self.adapter,
            adapter_sha256=self.adapter_sha256,
            prompt_tokens=len(self.prompt_ids),
            output_tokens=generated - self.released,  # a request that does not stream has released none before
        )
        self.released = n
        self.released_at = time.perf_counter()
        return chunk

    def _tokens_covering(self, char_index: int) -> int:
        """Fewest leading output tokens whose text reaches char_index."""
        for n in range(self.released, len(self.output_ids) + 1):
            if len(self.decoder.text_of(n)) >= char_index:
                return n
        return len(self.output_ids)

"""Response bodies and server-sent events in OpenAI's shapes.

A streamed chunk differs from the one before only in its text: each stream renders the constant
part of its chunk once (``_Stream.head``) and per chunk only JSON-escapes the text, so streaming
costs one ``json.dumps`` of a short string per chunk.
"""

from __future__ import annotations

import json
import secrets
import time

DONE = b"data: [DONE]\n\n"


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(body: dict) -> bytes:
    """An error after the stream began (the status line is already sent): vLLM's way, an event with the error."""
    return _event(body)


def completion(rid: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
               completion_tokens: int, fingerprint: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_completion(rid: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                    completion_tokens: int, fingerprint: str | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens)}


class _Stream:
    """The events of one streamed response: ``head`` + JSON text + ``tail`` per piece of text."""

    object_name = ""

    def __init__(self, rid: str, model: str, fingerprint: str | None) -> None:
        self.envelope = {"id": rid, "object": self.object_name, "created": int(time.time()), "model": model,
                         "system_fingerprint": fingerprint}
        prefix = json.dumps(self.envelope, separators=(",", ":"))[:-1]  # without the closing brace
        self.head, self.tail = self._text_frame(prefix)

    def _text_frame(self, prefix: str) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def text(self, piece: str) -> bytes:
        return self.head + json.dumps(piece, ensure_ascii=False).encode("utf-8") + self.tail

    def _choice_event(self, choice: dict) -> bytes:
        return _event({**self.envelope, "choices": [{"index": 0, "logprobs": None, **choice}]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last chunk of stream_options.include_usage: no choices, the usage."""
        return _event({**self.envelope, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})


class CompletionStream(_Stream):
    object_name = "text_completion"

    def _text_frame(self, prefix: str) -> tuple[bytes, bytes]:
        return (f'data: {prefix},"choices":[{{"index":0,"text":'.encode(),
                b',"logprobs":null,"finish_reason":null}]}\n\n')

    def first(self) -> bytes:
        return b""

    def finish(self, reason: str | None) -> bytes:
        return self._choice_event({"text": "", "finish_reason": reason})


class ChatStream(_Stream):
    object_name = "chat.completion.chunk"

    def _text_frame(self, prefix: str) -> tuple[bytes, bytes]:
        return (f'data: {prefix},"choices":[{{"index":0,"delta":{{"content":'.encode(),
                b'},"logprobs":null,"finish_reason":null}]}\n\n')

    def first(self) -> bytes:
        """OpenAI's first chat chunk names the role."""
        return self._choice_event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def finish(self, reason: str | None) -> bytes:
        return self._choice_event({"delta": {}, "finish_reason": reason})

"""Errors that cross the engine boundary, each naming what was wrong and the limit."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Maps one-to-one onto Triton's TritonError codes in the model files."""

    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNSUPPORTED = "UNSUPPORTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"


class RequestError(Exception):
    """A problem with one request: it gets an error response, other requests go on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses the engine process's pipe
        return (RequestError, (self.code, self.message))


class AdapterError(Exception):
    """An adapter that cannot be served; the message names the adapter and the reason."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"adapter '{adapter}': {reason}")
        self.adapter = adapter
        self.reason = reason


class ModelLoadError(Exception):
    """A base checkpoint that cannot be loaded; the message names the file and the reason."""

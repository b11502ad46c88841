"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP status that fits.

Errors the front finds itself (a bad value, an unsupported parameter) are raised as OpenAIError with
their status. Errors from the Triton server arrive over the gRPC stream as a message only (the stream
carries no status code), so ``from_server`` reads the status from the message: the server's messages
name the problem in fixed words (``unknown adapter 'x'``, ``queue full``, ``must be``).
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
# message pattern -> (HTTP status, OpenAI error type, code); the first that matches wins, else 400
SERVER_PATTERNS: tuple[tuple[re.Pattern, int, str, str | None], ...] = (
    (re.compile(r"unknown adapter|was refused at startup"), 404, "invalid_request_error", "model_not_found"),
    (re.compile(r"runtime adapter updates are off"), 403, "invalid_request_error", "adapter_management_off"),
    (re.compile(r"is already registered"), 400, "invalid_request_error", "adapter_exists"),
    (re.compile(r"queue full|shutting down|engine process|did not answer|is gone|[Ss]tub process|not ready|"
                r"UNAVAILABLE|failed to connect|[Cc]onnection refused|Socket closed"),
     503, "server_error", "unavailable"),
    (re.compile(r"step failed|generator failed|preprocessing failed|postprocessing failed|failed: |INTERNAL"),
     500, "server_error", None),
)


class OpenAIError(Exception):
    """A request that gets an error response: ``status`` and the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str, detail: str = "") -> OpenAIError:
    message = f"The model '{model}' does not exist" + (f": {detail}" if detail else "")
    return OpenAIError(404, message, param="model", code="model_not_found")


def from_server(message: str, model: str | None = None) -> OpenAIError:
    """The OpenAIError for an error message from the Triton server (module docstring)."""
    message = ENSEMBLE_PREFIX.sub("", message.strip())
    for pattern, status, type_, code in SERVER_PATTERNS:
        if pattern.search(message):
            if status == 404 and model is not None:
                return model_not_found(model, message)
            return OpenAIError(status, message, type_, code=code)
    return OpenAIError(400, message)

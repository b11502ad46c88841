"""The front's routes (FastAPI): generations, models, adapter management, health and metrics.

A generation is one gRPC call on the ``llm`` ensemble (triton.py). A streamed one answers with its
HTTP status only once the first response has come, so that an unknown adapter or a refused value is
a 404 / 400 like a non-streamed request's, not an error event after a 200. A client that goes away
cancels the call, streamed or not, and the server then stops the request in the engine: a stream
through Starlette's own watch of the connection, a non-streamed request (and a stream still waiting
for its first response) through ``_unless_gone``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from manylora.openai import admin, responses
from manylora.openai.config import FrontConfig
from manylora.openai.errors import OpenAIError
from manylora.openai.metrics import CONTENT_TYPE, CountingMiddleware, FrontCounters, RouterMetrics
from manylora.openai.models import ModelCatalog
from manylora.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    parse,
)
from manylora.openai.translate import chat_generation, completion_generation
from manylora.openai.triton import Chunk, Generation, TritonBackend

log = logging.getLogger("manylora.openai")
T = TypeVar("T")
CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection (never seen by that client)


class ClientGone(Exception):
    """The HTTP client closed the connection before its answer was ready."""


async def _until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read, so only that message is left)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result; if the client goes away first it is cancelled (so is its gRPC call) and ClientGone
    raised."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the client is gone; nothing to tell it
        await work
    raise ClientGone


async def _collect(chunks: AsyncIterator[Chunk]) -> tuple[str, str, int, int]:
    """(text, finish reason, prompt tokens, completion tokens) of a whole generation."""
    texts, reason, prompt_tokens, completion_tokens = [], "", 0, 0
    async for chunk in chunks:
        texts.append(chunk.text)
        reason = chunk.finish_reason or reason
        prompt_tokens = max(prompt_tokens, chunk.input_tokens)
        completion_tokens += chunk.output_tokens
    return "".join(texts), reason or "stop", prompt_tokens, completion_tokens


async def _first(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _events(stream: responses.CompletionStream | responses.ChatStream, first: Chunk | None,
                  chunks: AsyncIterator[Chunk], include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of one streamed generation whose first chunk has come."""
    reason, prompt_tokens, completion_tokens = "", 0, 0
    try:
        opening = stream.first()
        if opening:
            yield opening
        pending = [first] if first is not None else []
        while True:
            if pending:
                chunk = pending.pop()
            else:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            if chunk.text:
                yield stream.text(chunk.text)
            reason = chunk.finish_reason or reason
            prompt_tokens = max(prompt_tokens, chunk.input_tokens)
            completion_tokens += chunk.output_tokens
        yield stream.finish(reason or "stop")
        if include_usage:
            yield stream.usage(prompt_tokens, completion_tokens)
    except OpenAIError as e:  # after the status line: an event with the error, as vLLM sends it
        log.warning("stream failed after its start: %s", e.message)
        yield responses.error_event(e.body())
    finally:
        await chunks.aclose()  # cancels the gRPC call if the stream ends early (the client left)
    yield responses.DONE


def create_app(config: FrontConfig, backend: TritonBackend | None = None) -> FastAPI:
    """The front's ASGI application; ``backend`` defaults to a gRPC client of ``config.triton_url``."""
    backend = backend or TritonBackend(config.triton_url)
    catalog = ModelCatalog(config, backend)
    router_metrics = RouterMetrics(lambda: backend.control({"op": "stats"}), config.stats_interval_s)
    counters = FrontCounters()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="manylora OpenAI-compatible front", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.config, app.state.backend, app.state.catalog = config, backend, catalog
    app.add_middleware(CountingMiddleware, counters=counters)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(e.status_code, str(e.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return OpenAIError(500, f"the front failed: {type(e).__name__}: {e}", "server_error").response()

    async def _body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise OpenAIError(413, f"the body is {declared} bytes; at most {config.max_request_bytes} are accepted")
        chunks, size = [], 0
        async for piece in request.stream():
            size += len(piece)
            if size > config.max_request_bytes:
                raise OpenAIError(413, f"the body is over {config.max_request_bytes} bytes, the most accepted")
            chunks.append(piece)
        return b"".join(chunks)

    async def _generate(request: Request, gen: Generation, model: str, chat: bool, include_usage: bool) -> Response:
        rid = responses.request_id("chatcmpl" if chat else "cmpl")
        chunks = backend.generate(gen, rid, model=model, timeout_s=config.request_timeout_s)
        try:
            if not gen.stream:
                text, reason, n_in, n_out = await _unless_gone(request, _collect(chunks))
                make = responses.chat_completion if chat else responses.completion
                return JSONResponse(make(rid, model, text, reason, n_in, n_out, None))
            first = await _unless_gone(request, _first(chunks))
        except ClientGone:
            log.info("%s: the client left; its request was cancelled", rid)
            return Response(status_code=CLIENT_GONE)
        except BaseException:
            await chunks.aclose()
            raise
        stream = (responses.ChatStream if chat else responses.CompletionStream)(rid, model, None)
        return StreamingResponse(_events(stream, first, chunks, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _include_usage(req) -> bool:
        return bool(req.stream and req.stream_options and req.stream_options.include_usage)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(CompletionRequest, await _body(request))
        _, adapter = await catalog.resolve(req.model)
        gen = completion_generation(req, adapter, config.default_max_tokens)
        return await _generate(request, gen, req.model, False, _include_usage(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(ChatCompletionRequest, await _body(request))
        _, adapter = await catalog.resolve(req.model)
        gen = chat_generation(req, adapter, await catalog.info())
        return await _generate(request, gen, req.model, True, _include_usage(req))

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": await catalog.list_models()}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        return await catalog.find(model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        admin.check_operator(request.headers, config.allow_adapter_management, config.admin_key)
        return await admin.load_adapter(backend, parse(LoadLoraAdapterRequest, await _body(request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        admin.check_operator(request.headers, config.allow_adapter_management, config.admin_key)
        return await admin.unload_adapter(backend, parse(UnloadLoraAdapterRequest, await _body(request)))

    @app.get("/health")
    async def health() -> Response:
        """200 when the Triton server and its ``llm`` ensemble are ready, else 503."""
        ready = await backend.is_ready()
        return Response(status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = counters.render()
        try:
            text = await router_metrics.text() + text
        except OpenAIError as e:  # the front's own counters still go out; the scrape says the server is away
            text += f"# the engine's state is unavailable: {e.message[:200]}\n"
        return Response(text, media_type=CONTENT_TYPE)

    return app

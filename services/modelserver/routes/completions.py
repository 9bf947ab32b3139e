"""``POST /v1/chat/completions`` and ``POST /v1/completions``: decode, answer, release.

A request resolves its served name once (:meth:`ModelRegistry.acquire`) and holds that model
until its answer is complete, however it ends (answered, failed, or the client hung up), so
a hot swap never changes a model under a request and never frees one in use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from services.inference.engine import GenerationResult
from services.metrics import SERVING_REQUEST_DURATION
from services.modelserver.attestation import response_id
from services.modelserver.completion import Completion
from services.modelserver.openai_api import (
    VERSION_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from services.modelserver.registry import AdapterCold, LoadRefused, ModelNotFound, ServedModel
from services.modelserver.state import ServerDep, ServerState
from services.modelserver.text_completion import TextCompletion

logger = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, server: ServerDep
) -> Response:
    started = time.perf_counter()
    refused = body.unsupported() or body.unencodable()
    if refused is not None:
        raise refused
    messages = body.parsed_messages()
    tools = body.parsed_tools()
    forced = body.forced_tool(tools)
    served = await _acquire(server, body.model)
    try:
        completion = await Completion.create(
            body, served, messages, tools, forced, server.scheduler
        )
    except BaseException:
        server.registry.release(served)
        raise
    return await _answer(server, completion, request, started)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, server: ServerDep) -> Response:
    started = time.perf_counter()
    refused = body.unsupported() or body.unencodable()
    if refused is not None:
        raise refused
    served = await _acquire(server, body.model)
    try:
        completion: Completion = await TextCompletion.create_text(body, served, server.scheduler)
    except BaseException:
        server.registry.release(served)
        raise
    return await _answer(server, completion, request, started)


async def _acquire(server: ServerState, name: str) -> ServedModel:
    """The served model, held; a cold adapter is loaded off the event loop first."""
    try:
        try:
            return server.registry.acquire(name, load=False)
        except AdapterCold:
            return await run_in_threadpool(server.registry.acquire, name)
    except ModelNotFound:
        raise OpenAIError(
            404,
            f"the model {name!r} does not exist; GET /v1/models lists the served ones",
            param="model",
            code="model_not_found",
        ) from None
    except LoadRefused as exc:
        raise OpenAIError(
            503,
            f"the model {name!r} cannot be loaded: {exc}",
            kind="server_error",
            code="model_unavailable",
        ) from exc


async def _answer(
    server: ServerState, completion: Completion, request: Request, started: float
) -> Response:
    """Decode a rendered completion and answer it, streaming or whole; the served model
    is released however this ends."""
    served = completion.served
    try:
        completion.id = response_id(completion.ID_PREFIX, served.version, server.attestation_key)
        rows = completion.submit()
    except BaseException:
        server.registry.release(served)
        raise
    if completion.body.stream:
        return StreamingResponse(
            _released(server, completion, rows, request, started),
            media_type="text/event-stream",
            headers={VERSION_HEADER: served.version, "Cache-Control": "no-cache"},
        )
    watch = asyncio.ensure_future(_watch_disconnect(request, completion.hang_up))
    try:
        results = [await asyncio.wrap_future(future) for future in rows]
    except Exception as exc:
        server.stats.record(served.version, time.perf_counter() - started, failed=True)
        raise OpenAIError(
            500, f"generation failed: {exc}", kind="server_error", code="generation_failed"
        ) from exc
    finally:
        watch.cancel()
        server.registry.release(served)
    if completion.gone:  # nobody reads the answer
        server.stats.record(served.version, time.perf_counter() - started, failed=True)
        return Response(status_code=499)
    payload = completion.response(results)
    elapsed = time.perf_counter() - started
    tokens = payload["usage"]["completion_tokens"]
    server.stats.record(served.version, elapsed, failed=False, tokens=tokens)
    SERVING_REQUEST_DURATION.observe(elapsed)
    return JSONResponse(payload, headers={VERSION_HEADER: served.version})


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client hangs up (the body is read by then, so the next
    ASGI message is the disconnect); cancelled when the answer is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def _released(
    server: ServerState,
    completion: Completion,
    rows: list[Future[GenerationResult]],
    request: Request,
    started: float,
) -> AsyncIterator[str]:
    """Stream the completion, cancel its rows if the client hangs up, and give the model back
    at the end, however the stream ends."""
    served = completion.served
    failed = True
    watch = asyncio.ensure_future(_watch_disconnect(request, completion.hang_up))
    try:
        async for chunk in completion.stream(rows):
            yield chunk
        failed = completion.gone
    except Exception as exc:  # the status line is sent: the error goes in the stream
        logger.exception("streaming a completion failed")
        error = OpenAIError(500, f"generation failed: {exc}", kind="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        watch.cancel()
        if not completion.gone and not all(f.done() for f in rows):
            completion.hang_up()  # the stream was closed early: nobody reads the rest
        server.registry.release(served)
        server.stats.record(served.version, time.perf_counter() - started, failed=failed)

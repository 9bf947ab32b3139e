"""Every refusal and failure of the model server as OpenAI's error object.

The official ``openai`` client raises its usual errors (``BadRequestError``,
``NotFoundError``...) only for that shape, so validation errors, unknown routes and
unexpected failures are all answered with it, never with FastAPI's defaults or a traceback.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.modelserver.openai_api import OpenAIError, validation_error

logger = logging.getLogger(__name__)


def error_response(error: OpenAIError) -> Response:
    """OpenAI's error object as ASCII JSON (a lone surrogate in a message cannot break it)."""
    content = json.dumps(error.body(), ensure_ascii=True)
    return Response(
        content, status_code=error.status, media_type="application/json", headers=error.headers
    )


async def _openai_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def _invalid(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(list(exc.errors())))


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    response = error_response(OpenAIError(exc.status_code, str(exc.detail), code=code))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _unexpected(_request: Request, exc: Exception) -> Response:
    logger.exception("the model server failed on a request", exc_info=exc)
    return error_response(
        OpenAIError(500, "internal error", kind="server_error", code="internal_error")
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

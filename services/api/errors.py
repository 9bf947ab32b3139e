"""One error shape for every API response: ``{"error": {"code", "message", "fields"}}``.

Clients (and people reading curl output) get a stable code, a sentence, and for validation
errors the path of each field at fault.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.errors import RequestError

CLIENT_CLOSED_REQUEST = 499


class ApiError(RequestError):
    """An error with an HTTP status, a machine-readable code and a human message."""


def error_body(
    code: str, message: str, fields: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if fields:
        body["fields"] = fields
    return {"error": body}


def field_errors_from_validation(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic errors as ``{"path": "traces.0.outcome.success", "message": ...}`` items."""
    fields = []
    for error in errors:
        location = [str(part) for part in error.get("loc", ())]
        if location and location[0] in {"body", "query", "path", "header"}:
            location = location[1:]
        fields.append({"path": ".".join(location) or "(root)", "message": error.get("msg", "")})
    return fields


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _api_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.fields),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = field_errors_from_validation(list(exc.errors()))
        return JSONResponse(
            error_body("invalid_request", "the request does not match the schema", fields),
            status_code=422,
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_left(_: Request, exc: ClientDisconnect) -> Response:
        # The client hung up before its body arrived: nobody to answer, and not a server error.
        # 499 (as nginx logs it) is what the HTTP metrics record; the send goes nowhere.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            error_body(code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

"""Every refusal of the gateway in OpenAI's error shape, so agents' clients raise their usual
errors (``AuthenticationError`` for a 401, ``BadRequestError`` with ``param``...)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Send


class GatewayError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def unauthorized(message: str) -> GatewayError:
    return GatewayError(
        401,
        message,
        kind="authentication_error",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"the request body is over the limit of {limit} bytes", code="body_too_large"
    )


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    """A whole JSON answer (ASCII, so a lone surrogate in a message cannot break it)."""
    data = json.dumps(body, ensure_ascii=True).encode()
    await send_bytes(send, status, data, b"application/json", headers)


async def send_bytes(
    send: Send,
    status: int,
    data: bytes,
    content_type: bytes,
    headers: dict[str, str] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


async def send_error(send: Send, error: GatewayError) -> None:
    await send_json(send, error.status, error.body(), error.headers)

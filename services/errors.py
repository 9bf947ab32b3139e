"""The error a request can be refused with, shared by the ingest path and the api.

It carries the HTTP status, a stable code, a sentence and, for schema violations, the path of
each field at fault. It lives outside ``services.api`` so the ingest path (which must not
import the api) raises the same thing the api renders in its one error shape.
"""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request (or one item of it) that cannot be accepted, and why."""

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        fields: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.fields = fields or []
        self.headers = headers or {}

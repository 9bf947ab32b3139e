"""The one exception the ingest path raises for a request it cannot accept.

It carries the HTTP status, a stable code, a sentence and, for schema violations, the path of
each field at fault; the api turns it into its one error shape.
"""

from __future__ import annotations


class IngestError(Exception):
    """A request (or one item of it) that cannot be accepted, and why."""

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        fields: list[dict[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.fields = fields or []
        self.headers = headers or {}

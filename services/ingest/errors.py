"""The one exception the ingest path raises for a request it cannot accept.

A :class:`~services.errors.RequestError` (status, stable code, sentence, field paths); the
api renders it in its one error shape.
"""

from __future__ import annotations

from services.errors import RequestError


class IngestError(RequestError):
    """A request (or one item of it) that cannot be accepted, and why."""

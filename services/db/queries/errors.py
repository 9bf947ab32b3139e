"""The one error a query raises when a row the caller named does not exist.

Callers at the edges translate it once: the api answers 404 with its own wording, activities
fail with a non-retryable ``ApplicationError`` (a retry cannot create the row).
"""

from __future__ import annotations


class NotFound(LookupError):
    """A row the caller named does not exist."""

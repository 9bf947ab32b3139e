"""The one error a query raises when a row the caller named does not exist.

Callers at the edges translate it once: the api answers 404 with its own wording, activities
fail with a non-retryable ``ApplicationError`` (a retry cannot create the row).
"""

from __future__ import annotations

from typing import TypeVar

Row = TypeVar("Row")


class NotFound(LookupError):
    """A row the caller named does not exist."""


def existing(row: Row | None, named: str) -> Row:
    """``row``, or :class:`NotFound` saying ``<named> does not exist``: one wording for every
    missing row, which the edges translate."""
    if row is None:
        raise NotFound(f"{named} does not exist")
    return row

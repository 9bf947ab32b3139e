"""How activities report the errors that no retry can fix.

A bad policy, an unreadable results file or an invalid checkpoint fails the same way on
every attempt, so retrying it only delays the failure. Activities raise such errors as a
non-retryable ``ApplicationError`` whose ``type`` names what went wrong, so the workflow
(and the operator reading its history) can tell one from another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio.exceptions import ApplicationError


@contextmanager
def fails_as(
    error_type: str, *errors: type[Exception], context: str | None = None
) -> Iterator[None]:
    """Raise any of ``errors`` from the block as a non-retryable ``error_type``; the message
    is the error's, after ``context`` when given (``"loop 'x': <error>"``)."""
    try:
        yield
    except errors as exc:
        message = f"{context}: {exc}" if context is not None else str(exc)
        raise ApplicationError(message, type=error_type, non_retryable=True) from exc

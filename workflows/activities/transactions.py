"""The one way the loop's activities open a transaction, find the cycle an input names, and
report a serving target's failure.

Each activity that touches Postgres runs short transactions through :func:`transaction`, so
a row that is not there (an unknown loop or cycle) fails the activity for good instead of
being retried; a failure of the serving target is retried only where the target says a
retry can help (:func:`serving_failure`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.orm import Session
from temporalio.exceptions import ApplicationError

from services.db.models import Cycle, Loop
from services.db.queries import cycles as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.loop.policies import ServingTarget
from services.serving.base import ServingError
from workflows.activities.errors import fails_as


@contextmanager
def transaction(sessions: SessionFactory) -> Iterator[Session]:
    """A transaction whose 'not found' errors are not worth retrying."""
    with fails_as("NotFound", NotFound), sessions.begin() as session:
        yield session


def loop_cycle(
    session: Session, loop_name: str, number: int, *, for_update: bool = False
) -> tuple[Loop, Cycle]:
    """The loop and its cycle an input names; either missing is ``NotFound``.
    ``for_update`` locks the loop's row until the transaction ends."""
    loop = require_loop(session=session, name=loop_name, for_update=for_update)
    return loop, q.get_cycle(session=session, loop=loop, number=number)


def serving_failure(exc: ServingError) -> ApplicationError:
    """A serving target's error as the activity's: retryable only when the target says a
    retry can help (an unreachable server), never for a refused checkpoint."""
    return ApplicationError(str(exc), type=type(exc).__name__, non_retryable=not exc.retryable)


def serving_mapping(serving_target: ServingTarget) -> dict[str, Any]:
    """A payload's typed serving target as the mapping the serving targets read
    (services.serving parses it again, as recorded)."""
    return serving_target.model_dump(mode="json")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def parse_time(value: str | None) -> dt.datetime | None:
    """An ISO timestamp from a workflow payload (None or empty: no bound)."""
    return dt.datetime.fromisoformat(value) if value else None

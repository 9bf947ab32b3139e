"""Live outcomes: how the traces a loop's agents reported went. Never commits.

One question, one query: the canary's counts, the serving ledger's live success per tenure,
the demo's before/after and the dashboard's live success rate all come from
:func:`live_counts`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from services.db.models import Loop, Trace
from services.evaluation.stats import wilson_interval

# The live success rate of the dashboard is taken over this many most recent outcomes.
LIVE_WINDOW_TRACES = 200


@dataclass(frozen=True)
class LiveCounts:
    n: int
    successes: int
    # Traces left out because the model server did not vouch for the version they claim.
    unattested: int = 0

    @property
    def rate(self) -> float | None:
        """The success rate, or None when no trace reported an outcome."""
        return self.successes / self.n if self.n else None

    @property
    def interval(self) -> tuple[float, float]:
        """The rate's 95% Wilson interval."""
        return wilson_interval(self.successes, self.n)


def live_counts(
    *,
    session: Session,
    loop: Loop,
    model_version: str | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    limit: int = LIVE_WINDOW_TRACES,
    attested: Callable[[str | None, list[Any]], bool] | None = None,
) -> LiveCounts:
    """Outcomes of the newest ``limit`` traces (of a model version, in a time window when
    given) that reported one; with ``attested`` (a trace's claimed version and
    ``response_ids`` in, whether the model server vouches for them out), of those among them
    it accepts: the others are the client's word only."""
    recent = (
        select(Trace.success)
        .where(Trace.loop_id == loop.id, Trace.success.is_not(None))
        .order_by(Trace.received_at.desc())
        .limit(limit)
    )
    if model_version is not None:
        recent = recent.where(Trace.model_version == model_version)
    if since is not None:
        recent = recent.where(Trace.received_at >= since)
    if until is not None:
        recent = recent.where(Trace.received_at < until)
    if attested is not None:
        rows = session.execute(
            recent.add_columns(Trace.model_version, Trace.body["response_ids"])
        ).all()
        kept = [success for success, version, ids in rows if attested(version, _list(ids))]
        return LiveCounts(len(kept), sum(1 for success in kept if success), len(rows) - len(kept))
    window = recent.subquery()
    n, successes = session.execute(
        select(func.count(), func.coalesce(func.sum(cast(window.c.success, Integer)), 0))
    ).one()
    return LiveCounts(int(n), int(successes))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

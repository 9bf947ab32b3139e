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

from sqlalchemy import Integer, ScalarSelect, Select, cast, func, select
from sqlalchemy.orm import Session

from services.db.models import Loop, Trace, TraceBody
from services.evaluation.stats import wilson_interval

# The live success rate of the dashboard is taken over this many most recent outcomes.
LIVE_WINDOW_TRACES = 200
# With attestation, the newest traces are read until the window holds ``limit`` counted ones,
# at most this many: a flood of unsigned traces can hide older signed ones beyond it, and
# says so (``LiveCounts.unattested``) instead of costing the canary unbounded reads.
MAX_SCANNED_TRACES = 50_000
SCAN_BATCH = 1_000


@dataclass(frozen=True)
class LiveCounts:
    n: int
    successes: int
    # Traces left out because the model server did not vouch for the version they claim, or
    # because a response id they carry was already counted on another trace.
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
    given) that reported one. With ``attested`` (a trace's claimed version and
    ``response_ids`` in, whether the model server vouches for them out) only the traces it
    accepts count, see :func:`_attested_counts`: the others are the client's word only."""
    recent = (
        select(Trace.success)
        .where(Trace.loop_id == loop.id, Trace.success.is_not(None))
        .order_by(Trace.received_at.desc(), Trace.id.desc())
    )
    if model_version is not None:
        recent = recent.where(Trace.model_version == model_version)
    if since is not None:
        recent = recent.where(Trace.received_at >= since)
    if until is not None:
        recent = recent.where(Trace.received_at < until)
    if attested is not None:
        # The ids in the body, read from the partitions of the window only.
        body = select(TraceBody.body["response_ids"]).where(
            TraceBody.trace_id == Trace.id, TraceBody.received_at == Trace.received_at
        )
        if since is not None:
            body = body.where(TraceBody.received_at >= since)
        if until is not None:
            body = body.where(TraceBody.received_at < until)
        response_ids = body.correlate(Trace).scalar_subquery()
        return _attested_counts(session, recent, response_ids, attested, limit)
    window = recent.limit(limit).subquery()
    n, successes = session.execute(
        select(func.count(), func.coalesce(func.sum(cast(window.c.success, Integer)), 0))
    ).one()
    return LiveCounts(int(n), int(successes))


def _attested_counts(
    session: Session,
    recent: Select[Any],
    response_ids: ScalarSelect[Any],
    attested: Callable[[str | None, list[Any]], bool],
    limit: int,
) -> LiveCounts:
    """The newest ``limit`` traces the server vouches for, each signed id counted once.

    Two ways a client could decide the canary are closed here (issue 43). The window is
    filled *after* the filter: the newest traces are read (at most
    :data:`MAX_SCANNED_TRACES`) until ``limit`` of them count, so a flood of unsigned traces
    cannot push the signed ones out of a window cut first. And a response id counts on
    one trace only (the newest that carries it): an id proves that the server answered one
    request, so one genuine id copied onto any number of made-up traces vouches for one.
    """
    rows = session.execute(
        recent.add_columns(Trace.model_version, response_ids)
        .limit(MAX_SCANNED_TRACES)
        .execution_options(yield_per=SCAN_BATCH)
    )
    counted: set[str] = set()
    n = successes = left_out = 0
    for success, version, raw_ids in rows:
        ids = _list(raw_ids)
        if not attested(version, ids) or not counted.isdisjoint(ids):
            left_out += 1
            continue
        counted.update(ids)
        n += 1
        successes += bool(success)
        if n == limit:
            break
    rows.close()
    return LiveCounts(n, successes, left_out)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

"""Trace rows: the group-commit insert of the ingest writer, lookups by external id, and
what curation and the drift signal read and stamp (uncurated traces, failure windows).

Every function takes the session keyword-only and never commits. The writer's insert is
plain SQL for psycopg (the hot path). A group of traces is COPYed into
a per-connection temporary staging table, then moved with one ``INSERT ... SELECT ... ON
CONFLICT (loop_id, external_id) DO NOTHING RETURNING``: COPY moves the rows at close to the
speed of a plain COPY (binding arrays of large JSON strings as parameters costs several times
more in the driver), the conflict clause makes a re-post a no-op, and ``RETURNING`` says which
rows were new, so every item can be told "accepted" or "duplicate". Rows are moved in key
order, so concurrent writers (other api replicas) take row locks in one order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Text, cast, func, select, text
from sqlalchemy.orm import Session

from services.db.models import Trace

TRACE_COLUMNS = (
    "loop_id",
    "external_id",
    "source",
    "model_version",
    "success",
    "score",
    "error_kind",
    "body",
    "size_bytes",
    "started_at",
    "ended_at",
)
_COLUMNS = ", ".join(TRACE_COLUMNS)

CREATE_STAGE_SQL = (
    "CREATE TEMP TABLE IF NOT EXISTS ingest_stage ("
    "loop_id bigint, external_id text, source text, model_version text, success boolean, "
    "score float8, error_kind text, body text, size_bytes integer, started_at timestamptz, "
    "ended_at timestamptz) ON COMMIT DELETE ROWS"
)
COPY_STAGE_SQL = f"COPY ingest_stage ({_COLUMNS}) FROM STDIN (FORMAT BINARY)"
# The staging table's column types, in TRACE_COLUMNS order, for the binary COPY.
STAGE_TYPES = (
    "int8",
    "text",
    "text",
    "text",
    "bool",
    "float8",
    "text",
    "text",
    "int4",
    "timestamptz",
    "timestamptz",
)
INSERT_FROM_STAGE_SQL = (
    f"INSERT INTO traces ({_COLUMNS}) "
    f"SELECT {_COLUMNS.replace('body', 'body::jsonb')} FROM ingest_stage "
    "ORDER BY loop_id, external_id "
    "ON CONFLICT (loop_id, external_id) DO NOTHING "
    "RETURNING id, loop_id, external_id"
)
INSERT_TRACE_SQL = (
    f"INSERT INTO traces ({_COLUMNS}) "
    f"VALUES ({', '.join('%s::jsonb' if name == 'body' else '%s' for name in TRACE_COLUMNS)}) "
    "ON CONFLICT (loop_id, external_id) DO NOTHING "
    "RETURNING id, loop_id, external_id"
)


@dataclass(frozen=True)
class TraceRow:
    """An uncurated trace, locked for this transaction."""

    id: int
    external_id: str
    model_version: str | None
    success: bool | None
    score: float | None
    error_kind: str | None
    body_json: str  # the body as Postgres sends it; decoded once, where it is curated
    size_bytes: int


@dataclass(frozen=True)
class Verdict:
    """What curation decided about one trace (written to the trace row)."""

    trace_id: int
    outcome: str
    detail: str


_TRACE_ROW_COLUMNS = (
    Trace.id,
    Trace.external_id,
    Trace.model_version,
    Trace.success,
    Trace.score,
    Trace.error_kind,
    cast(Trace.body, Text),
    Trace.size_bytes,
)


def lock_uncurated_traces(*, session: Session, loop_id: int, limit: int) -> list[TraceRow]:
    """The oldest uncurated traces of a loop, locked; rows another batch holds are skipped."""
    rows = session.execute(
        select(*_TRACE_ROW_COLUMNS)
        .where(Trace.loop_id == loop_id, Trace.curated_at.is_(None))
        .order_by(Trace.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    return [TraceRow(*row) for row in rows]


def peek_uncurated_traces(
    *, session: Session, loop_id: int, after_id: int, limit: int
) -> list[TraceRow]:
    """The next uncurated traces after ``after_id``, read without locking them: what the
    loop's next batch will most likely lock (curation prepares them ahead of time and
    checks each row again when the batch really has it)."""
    rows = session.execute(
        select(*_TRACE_ROW_COLUMNS)
        .where(Trace.loop_id == loop_id, Trace.curated_at.is_(None), Trace.id > after_id)
        .order_by(Trace.id)
        .limit(limit)
    ).all()
    return [TraceRow(*row) for row in rows]


def mark_traces_curated(*, session: Session, verdicts: Sequence[Verdict]) -> None:
    """Stamp ``curated_at`` and the verdict on each trace (same transaction as its task)."""
    if not verdicts:
        return
    session.execute(
        text(
            """
            UPDATE traces AS t
               SET curated_at = now(), curation_outcome = v.outcome, curation_detail = v.detail
              FROM unnest(CAST(:ids AS bigint[]), CAST(:outcomes AS text[]),
                          CAST(:details AS text[])) AS v(id, outcome, detail)
             WHERE t.id = v.id
            """
        ),
        {
            "ids": [v.trace_id for v in verdicts],
            "outcomes": [v.outcome for v in verdicts],
            "details": [v.detail for v in verdicts],
        },
    )


def count_uncurated_traces(*, session: Session, loop_id: int) -> int:
    return int(
        session.execute(
            select(func.count()).where(Trace.loop_id == loop_id, Trace.curated_at.is_(None))
        ).scalar_one()
    )


def latest_model_version(*, session: Session, loop_id: int) -> str | None:
    """The model version of the loop's most recently received trace (the one serving)."""
    row = session.execute(
        select(Trace.model_version)
        .where(Trace.loop_id == loop_id, Trace.model_version.is_not(None))
        .order_by(Trace.received_at.desc(), Trace.id.desc())
        .limit(1)
    ).first()
    return row[0] if row is not None else None


def failure_window(
    *,
    session: Session,
    loop_id: int,
    model_version: str,
    window: int,
    failure_score_threshold: float | None,
) -> tuple[int, int]:
    """``(traces with an outcome, failures)`` among the last ``window`` traces of a version.

    The failure test is :func:`services.curation.selection.classify` in SQL.
    """
    row = session.execute(
        text(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE success IS FALSE
                                       OR coalesce(error_kind, '') <> ''
                                       OR (CAST(:threshold AS double precision) IS NOT NULL
                                           AND score < CAST(:threshold AS double precision)))
              FROM (SELECT success, score, error_kind FROM traces
                     WHERE loop_id = :loop_id AND model_version = :model_version
                       AND (success IS NOT NULL OR score IS NOT NULL
                            OR coalesce(error_kind, '') <> '')
                     ORDER BY received_at DESC, id DESC
                     LIMIT :window) AS recent
            """
        ),
        {
            "loop_id": loop_id,
            "model_version": model_version,
            "window": window,
            "threshold": failure_score_threshold,
        },
    ).one()
    return int(row[0]), int(row[1])

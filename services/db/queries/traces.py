"""Trace rows: the group-commit insert of the ingest writer, and lookups by external id.

The writer's insert is plain SQL for psycopg (the hot path). A group of traces is COPYed into
a per-connection temporary staging table, then moved with one ``INSERT ... SELECT ... ON
CONFLICT (loop_id, external_id) DO NOTHING RETURNING``: COPY moves the rows at close to the
speed of a plain COPY (binding arrays of large JSON strings as parameters costs several times
more in the driver), the conflict clause makes a re-post a no-op, and ``RETURNING`` says which
rows were new, so every item can be told "accepted" or "duplicate". Rows are moved in key
order, so concurrent writers (other api replicas) take row locks in one order.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select, tuple_
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


def get_trace(*, session: Session, loop_id: int, external_id: str) -> Trace | None:
    return session.scalar(
        select(Trace).where(Trace.loop_id == loop_id, Trace.external_id == external_id)
    )


def count_traces(*, session: Session, loop_id: int) -> int:
    return (
        session.scalar(select(func.count()).select_from(Trace).where(Trace.loop_id == loop_id)) or 0
    )


def existing_external_ids(
    *, session: Session, loop_id: int, external_ids: Sequence[str]
) -> set[str]:
    """Which of ``external_ids`` are stored for the loop."""
    if not external_ids:
        return set()
    found = session.scalars(
        select(Trace.external_id).where(
            tuple_(Trace.loop_id, Trace.external_id).in_([(loop_id, e) for e in external_ids])
        )
    )
    return set(found)

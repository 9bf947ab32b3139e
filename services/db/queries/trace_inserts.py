"""The ingest writer's insert of traces (services.ingest.writer): plain SQL for psycopg, the
hot path.

A group of traces is COPYed into a per-connection temporary staging table, then moved with
one ``INSERT ... SELECT ... ON CONFLICT (loop_id, external_id) DO NOTHING RETURNING``: COPY
moves the rows at close to the speed of a plain COPY (binding arrays of large JSON strings as
parameters costs several times more in the driver), the conflict clause makes a re-post a
no-op, and ``RETURNING`` says which rows were new, so every item can be told "accepted" or
"duplicate". Rows are moved in key order, so concurrent writers (other api replicas) take row
locks in one order. The same statement puts each new row's body into ``trace_bodies``
(partitioned by ``received_at``, services.db.partitions), keyed by the row's id and time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.models import Trace, TraceBody

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
# The columns of the trace row: all but the body, which goes to ``trace_bodies``.
_ROW_COLUMNS = ", ".join(name for name in TRACE_COLUMNS if name != "body")
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
# The new rows' bodies go to their partition of ``trace_bodies`` in the same statement, keyed
# by the row's id and ``received_at`` (the transaction's time, read back from the row).
INSERT_FROM_STAGE_SQL = (
    "WITH new AS ("
    f"INSERT INTO traces ({_ROW_COLUMNS}) "
    f"SELECT {_ROW_COLUMNS} FROM ingest_stage "
    "ORDER BY loop_id, external_id "
    "ON CONFLICT (loop_id, external_id) DO NOTHING "
    "RETURNING id, loop_id, external_id, received_at"
    "), bodies AS ("
    "INSERT INTO trace_bodies (trace_id, received_at, body) "
    "SELECT new.id, new.received_at, s.body::jsonb FROM new "
    "JOIN ingest_stage AS s USING (loop_id, external_id)"
    ") SELECT id, loop_id, external_id FROM new"
)
INSERT_TRACE_SQL = (
    "WITH new AS ("
    f"INSERT INTO traces ({_ROW_COLUMNS}) "
    f"VALUES ({', '.join('%s' for name in TRACE_COLUMNS if name != 'body')}) "
    "ON CONFLICT (loop_id, external_id) DO NOTHING "
    "RETURNING id, loop_id, external_id, received_at"
    "), bodies AS ("
    "INSERT INTO trace_bodies (trace_id, received_at, body) "
    "SELECT id, received_at, %s::jsonb FROM new"
    ") SELECT id, loop_id, external_id FROM new"
)


def insert_trace_params(values: Sequence[Any]) -> tuple[Any, ...]:
    """The parameters of :data:`INSERT_TRACE_SQL` for one row of TRACE_COLUMNS values."""
    body = TRACE_COLUMNS.index("body")
    return (*values[:body], *values[body + 1 :], values[body])


# The rows the staged traces repeat (run when some were not inserted): a duplicate's answer
# names the trace already stored.
STAGED_IDS_SQL = (
    "SELECT t.id, t.loop_id, t.external_id FROM traces AS t "
    "JOIN ingest_stage AS s USING (loop_id, external_id)"
)
TRACE_ID_SQL = "SELECT id FROM traces WHERE loop_id = %s AND external_id = %s"


def insert_trace(*, session: Session, loop_id: int, source: str, values: dict[str, Any]) -> int:
    """Store one trace through the ORM session (a door with its own transaction, e.g. the
    capture gateway's assembler): ``values`` are the row's columns plus ``body`` (a dict),
    which goes to ``trace_bodies`` with the row's id and ``received_at``. The row id; the
    existing row's when (loop, external id) was stored before (a no-op)."""
    row = {key: value for key, value in values.items() if key != "body"}
    inserted = session.execute(
        pg_insert(Trace)
        .values(loop_id=loop_id, source=source, **row)
        .on_conflict_do_nothing(index_elements=["loop_id", "external_id"])
        .returning(Trace.id, Trace.received_at)
    ).first()
    if inserted is not None:
        trace_id, received_at = inserted
        session.execute(
            pg_insert(TraceBody).values(
                trace_id=trace_id, received_at=received_at, body=values["body"]
            )
        )
        return int(trace_id)
    return int(
        session.execute(
            select(Trace.id).where(
                Trace.loop_id == loop_id, Trace.external_id == values["external_id"]
            )
        ).scalar_one()
    )

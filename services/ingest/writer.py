"""The group-commit writer: many requests' traces in few transactions, acknowledged after COMMIT.

Requests put their traces on a bounded in-memory queue and wait on a future. One writer task
drains the queue: it takes everything waiting (up to ``max_rows``), COPYs it into a staging
table and moves it with one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING RETURNING`` in one
transaction (see services.db.queries.traces), commits, and only then resolves the futures.
So a 2xx always means "committed", and the cost of a commit (a WAL flush) is shared by every
request that arrived while the previous one was in flight: under load batches grow by
themselves; when idle a trace waits at most ``max_wait_s`` for company.

Failure handling, in order of likelihood:
- a full queue: the request is refused at once (503 + Retry-After) and nothing is queued;
- Postgres unreachable or the connection lost: every trace of the group is answered 503 (it
  may or may not have been committed: the client retries and a committed one comes back as a
  duplicate, still a 2xx); for ``RETRY_AFTER_S`` new requests are refused without queueing;
- a row Postgres refuses (a data error the validator could not foresee, a loop deleted
  meanwhile): the group is retried row by row under savepoints, so one bad row is rejected
  alone and its neighbours are stored.

psycopg is used directly (not the ORM) because this is the hot path: measured on the dev
machine, COPY + INSERT ... SELECT moves ~1.5x the rows per second of the ORM's executemany
and ~4x those of an unnest INSERT with array parameters (see docs/ingest.md). The connection
parameters come from the api's SQLAlchemy engine.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from services.db.queries.trace_inserts import (
    COPY_STAGE_SQL,
    CREATE_STAGE_SQL,
    INSERT_FROM_STAGE_SQL,
    INSERT_TRACE_SQL,
    STAGE_TYPES,
    STAGED_IDS_SQL,
    TRACE_ID_SQL,
    insert_trace_params,
)
from services.ingest.errors import IngestError
from services.ingest.schema import StoredTrace
from services.metrics import INGEST_COMMIT_DURATION, INGEST_COMMIT_ROWS, INGEST_QUEUE_DEPTH

log = logging.getLogger(__name__)


class WriteStatus(enum.StrEnum):
    """What became of one trace the writer was given; the ingest answer's ``status`` of
    each item, and the kinds its counts and metrics are by."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"


class StorageRefused(IngestError):
    """Postgres refused the write for a reason a retry cannot fix (a missing table or
    privilege, a schema that does not match the code): a 500 that says so, never a 503 whose
    ``Retry-After`` would have senders retry for ever."""

    def __init__(self, message: str) -> None:
        super().__init__(500, "storage_error", message)


def retryable(exc: psycopg.Error) -> bool:
    """Whether a Postgres error may go away on its own: connection trouble, serialization
    failures and deadlocks, lack of resources, an operator shutting the server down, a lock
    or statement timeout (SQLSTATE classes 08, 40, 53, 57, 58 and 55P03)."""
    state = exc.sqlstate or ""
    return state[:2] in {"08", "40", "53", "57", "58"} or state == "55P03"


# The Retry-After of every 503 the ingest doors answer when Postgres is down or the queue is
# full, and how long the writer refuses new requests after losing its connection.
RETRY_AFTER_S = 1
# A group commit still running after this long is given up like a lost connection.
COMMIT_TIMEOUT_S = 30.0


class StorageUnavailable(Exception):
    """The traces cannot be stored now; the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# Not frozen: a frozen dataclass's __init__ costs ~3x (object.__setattr__ per field), and
# one of these is built per trace on the ingest hot path. Treat instances as read-only.
@dataclass(slots=True)
class TraceRow:
    """One trace to store, with its loop and the door it came through."""

    loop_id: int
    source: str
    trace: StoredTrace

    def values(self) -> tuple[Any, ...]:
        t = self.trace
        return (
            self.loop_id,
            t.external_id,
            self.source,
            t.model_version,
            t.success,
            t.score,
            t.error_kind,
            t.body_json,
            t.size_bytes,
            t.started_at,
            t.ended_at,
        )


# Not frozen: a frozen dataclass's __init__ costs ~3x (object.__setattr__ per field), and
# one of these is built per trace on the ingest hot path. Treat instances as read-only.
@dataclass(slots=True)
class WriteOutcome:
    """What happened to one trace: stored (with its row id), already there (with the id of
    the row it repeats), or refused."""

    status: WriteStatus
    trace_id: int | None = None
    reason: str | None = None


@dataclass
class _Submission:
    rows: list[TraceRow]
    future: asyncio.Future[list[WriteOutcome]]


_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError)
_ROW_ERRORS = (pg_errors.DataError, pg_errors.IntegrityError)


class GroupCommitWriter:
    """Owns one Postgres connection and the queue in front of it. See the module docstring."""

    def __init__(
        self,
        conninfo: str,
        *,
        queue_max: int,
        max_rows: int,
        max_wait_s: float,
    ) -> None:
        self._conninfo = conninfo
        self._queue_max = queue_max
        self._max_rows = max_rows
        self._max_wait_s = max_wait_s
        self._pending: deque[_Submission] = deque()
        self._depth = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._down_until = 0.0

    @property
    def depth(self) -> int:
        """Traces waiting in the queue or in the commit in flight."""
        return self._depth

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._closing

    async def start(self) -> None:
        """Start the writer task. The connection opens on first use, so the api starts (and
        serves health) while Postgres is down."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ingest-writer")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop taking traces, write what is queued (up to ``timeout_s``), close the connection."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(StorageUnavailable("the api is shutting down"))
        await self._close_connection()

    async def write(self, rows: list[TraceRow]) -> list[WriteOutcome]:
        """Queue ``rows`` and wait until they are committed; one outcome per row, in order.

        Raises :class:`StorageUnavailable` (nothing was acknowledged) when the queue is full,
        Postgres is down, or the writer is stopping.
        """
        if not rows:
            return []
        if not self.running:
            raise StorageUnavailable("the trace writer is not running")
        if time.monotonic() < self._down_until:
            raise StorageUnavailable("Postgres is unreachable; traces cannot be stored now")
        if self._depth + len(rows) > self._queue_max:
            raise StorageUnavailable(
                f"the write queue is full ({self._depth} traces waiting); retry shortly"
            )
        future: asyncio.Future[list[WriteOutcome]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Submission(rows, future))
        self._depth += len(rows)
        INGEST_QUEUE_DEPTH.set(self._depth)
        self._wake.set()
        # Shielded: a client that hangs up does not cancel the write of its traces.
        return await asyncio.shield(future)

    # The writer task ----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._max_wait_s > 0 and self._depth < self._max_rows and not self._closing:
                await asyncio.sleep(self._max_wait_s)
            batch = self._take()
            try:
                await self._commit_group(batch)
            except Exception as exc:  # keep the writer alive whatever happens to one group
                log.exception("ingest writer: unexpected error, %d traces refused", len(batch))
                self._resolve_error(batch, exc)

    def _take(self) -> list[_Submission]:
        batch: list[_Submission] = []
        rows = 0
        while self._pending and (not batch or rows + len(self._pending[0].rows) <= self._max_rows):
            submission = self._pending.popleft()
            batch.append(submission)
            rows += len(submission.rows)
        return batch

    async def _commit_group(self, batch: list[_Submission]) -> None:
        rows = [row for submission in batch for row in submission.rows]
        started = time.perf_counter()
        try:
            outcomes = await asyncio.wait_for(self._insert(rows), COMMIT_TIMEOUT_S)
        except _CONNECTION_ERRORS as exc:
            log.warning(
                "ingest writer: Postgres unavailable (%s); %d traces refused", exc, len(rows)
            )
            self._down_until = time.monotonic() + RETRY_AFTER_S
            await self._close_connection()
            self._resolve_error(
                batch,
                StorageUnavailable(
                    f"Postgres is unavailable ({type(exc).__name__}); nothing was acknowledged"
                ),
            )
            return
        except psycopg.Error as exc:
            log.error("ingest writer: database error %s; %d traces refused", exc, len(rows))
            await self._close_connection()
            failure: Exception
            if retryable(exc):
                failure = StorageUnavailable(
                    f"the database could not take the write now ({type(exc).__name__}); "
                    "nothing was acknowledged"
                )
            else:
                failure = StorageRefused(
                    f"the database refused the write ({type(exc).__name__}: "
                    f"{exc.diag.message_primary or 'no detail'}); nothing was stored. This is "
                    "a server problem (is `ratchet db upgrade` done?), not one of the request"
                )
            self._resolve_error(batch, failure)
            return
        finally:
            self._depth -= len(rows)
            INGEST_QUEUE_DEPTH.set(self._depth)
        INGEST_COMMIT_DURATION.observe(time.perf_counter() - started)
        INGEST_COMMIT_ROWS.observe(len(rows))
        offset = 0
        for submission in batch:
            count = len(submission.rows)
            if not submission.future.done():
                submission.future.set_result(outcomes[offset : offset + count])
            offset += count

    def _resolve_error(self, batch: list[_Submission], exc: BaseException) -> None:
        for submission in batch:
            if not submission.future.done():
                submission.future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        while self._pending:
            submission = self._pending.popleft()
            self._depth -= len(submission.rows)
            if not submission.future.done():
                submission.future.set_exception(exc)
        INGEST_QUEUE_DEPTH.set(self._depth)

    # Postgres -----------------------------------------------------------------------------

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None or self._connection.closed or self._connection.broken:
            connection = await psycopg.AsyncConnection.connect(
                self._conninfo,
                autocommit=True,
                application_name="ratchet-ingest",
                connect_timeout=5,
            )
            await connection.execute(CREATE_STAGE_SQL)
            self._connection = connection
        return self._connection

    async def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.close()
            except Exception:  # a broken connection may fail to close; it is gone either way
                log.debug("ingest writer: closing a broken connection failed", exc_info=True)

    async def _insert(self, rows: list[TraceRow]) -> list[WriteOutcome]:
        """Insert a group in one transaction; an outcome per row, in the order given."""
        connection = await self._connect()
        first_index: dict[tuple[int, str], int] = {}
        for index, row in enumerate(rows):
            first_index.setdefault((row.loop_id, row.trace.external_id), index)
        # Sorted by key, so concurrent writers (other api replicas) lock rows in one order.
        unique = sorted(first_index.items())
        try:
            async with connection.transaction():
                cursor = connection.cursor()
                async with cursor.copy(COPY_STAGE_SQL) as copy:
                    copy.set_types(STAGE_TYPES)
                    for _, index in unique:
                        await copy.write_row(rows[index].values())
                await cursor.execute(INSERT_FROM_STAGE_SQL)
                inserted = {
                    (loop_id, external_id): tid
                    for tid, loop_id, external_id in await cursor.fetchall()
                }
                stored = inserted
                if len(inserted) < len(unique):  # duplicates: the rows they repeat
                    await cursor.execute(STAGED_IDS_SQL)
                    stored = {
                        (loop, external): tid for tid, loop, external in await cursor.fetchall()
                    }
            refused: dict[int, str] = {}
        except _ROW_ERRORS:
            inserted, stored, refused = await self._insert_one_by_one(connection, rows, unique)
        outcomes = []
        for index, row in enumerate(rows):
            key = (row.loop_id, row.trace.external_id)
            first = first_index[key]
            if first in refused:
                outcomes.append(WriteOutcome(WriteStatus.REJECTED, reason=refused[first]))
            elif first == index and key in inserted:
                outcomes.append(WriteOutcome(WriteStatus.ACCEPTED, trace_id=inserted[key]))
            else:
                outcomes.append(WriteOutcome(WriteStatus.DUPLICATE, trace_id=stored.get(key)))
        return outcomes

    async def _insert_one_by_one(
        self,
        connection: psycopg.AsyncConnection[Any],
        rows: list[TraceRow],
        unique: list[tuple[tuple[int, str], int]],
    ) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int], dict[int, str]]:
        """The slow path after a row error: each row under its own savepoint. The rows
        inserted, every stored row's id (duplicates' too), and the refused rows' reasons."""
        inserted: dict[tuple[int, str], int] = {}
        stored: dict[tuple[int, str], int] = {}
        refused: dict[int, str] = {}
        async with connection.transaction():
            for key, index in unique:
                try:
                    async with connection.transaction():
                        cursor = await connection.execute(
                            INSERT_TRACE_SQL, insert_trace_params(rows[index].values())
                        )
                        found = await cursor.fetchone()
                        if found is None:  # a duplicate: the row it repeats
                            cursor = await connection.execute(TRACE_ID_SQL, key)
                            found = await cursor.fetchone()
                        else:
                            inserted[key] = found[0]
                except _ROW_ERRORS as exc:
                    refused[index] = f"the database refused the trace: {exc.diag.message_primary}"
                    continue
                if found is not None:
                    stored[key] = found[0]
        return inserted, stored, refused

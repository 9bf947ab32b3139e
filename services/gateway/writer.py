"""The spool's drain: captured calls from the local spool into ``gateway_calls``.

One task per gateway process reads a batch of records from the spool and makes them rows
(decoded, digested, their bodies encoded as JSON) on a worker thread, off the event loop that
answers agents (a batch of 500 made there held it for tens of milliseconds); inserts them in
one transaction (``INSERT ... ON CONFLICT (call_id) DO NOTHING``, so a batch
drained twice after a crash stores each call once) and only then moves the spool's cursor.
While Postgres is down the batch stays in the spool and the writer retries with a growing
pause (at most :data:`MAX_BACKOFF_S`); the gateway answers agents all the while, since
nothing on the request path waits for this task. A record that cannot be decoded, or a row
Postgres refuses (its loop was deleted meanwhile), is skipped alone and counted as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from services.chat.text import storable_json, valid_text
from services.gateway.capture import CapturedCall
from services.gateway.spool import Record, Spool
from services.metrics import GATEWAY_DROPPED, GATEWAY_SPOOL_BYTES, GATEWAY_STORED

log = logging.getLogger(__name__)

BATCH = 500
IDLE_WAIT_S = 0.05
MAX_BACKOFF_S = 5.0

INSERT_CALL_SQL = (
    "INSERT INTO gateway_calls (loop_id, call_id, kind, started_at, captured_at, session_key, "
    "model_version, response_id, prefix_hashes, after_hash, body) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb) "
    "ON CONFLICT (call_id) DO NOTHING"
)

_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError, OSError, TimeoutError)
_ROW_ERRORS = (pg_errors.DataError, pg_errors.IntegrityError)


def _timestamp(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def call_row(call: CapturedCall) -> tuple[Any, ...]:
    """The ``gateway_calls`` row of a captured call, digests computed here (of the text as
    the agent and the upstream sent it). Its text is made storable (services.chat.text): a
    model may sample a NUL and an agent may send one, and Postgres refusing the row would
    lose a call the agent was answered for."""
    prefixes, after = call.digests()
    return (
        call.loop_id,
        call.call_id,
        call.kind,
        _timestamp(call.started_at),
        _timestamp(call.captured_at),
        _storable(call.session_key),
        _storable(call.model_version),
        _storable(call.response_id),
        prefixes,
        after,
        storable_json(call.body()),
    )


def _storable(text: str | None) -> str | None:
    return None if text is None else valid_text(text)


@dataclass
class _Decoded:
    rows: list[tuple[Any, ...]]
    loops: list[str]
    refused: int = 0


class SpoolWriter:
    """See the module docstring."""

    def __init__(self, spool: Spool, conninfo: str) -> None:
        self.spool = spool
        self._conninfo = conninfo
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.stored = 0
        self.connected = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gateway-writer")

    def wake(self) -> None:
        """A record was appended: drain without waiting for the next poll."""
        self._wake.set()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Drain what the spool holds (up to ``timeout_s``), then close the connection. What is
        left stays in the spool for the next start."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        await self._close()

    async def _run(self) -> None:
        backoff = 0.0
        while True:
            records, decoded = await asyncio.to_thread(self._read)
            GATEWAY_SPOOL_BYTES.set(self.spool.pending_bytes)
            if not records:
                if self._closing:
                    return
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), IDLE_WAIT_S)
                continue
            try:
                await self._store(records, decoded)
                backoff = 0.0
            except _CONNECTION_ERRORS as exc:
                backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF_S)
                log.warning(
                    "gateway writer: Postgres unavailable (%s); retry in %.1fs", exc, backoff
                )
                self.connected = False
                await self._close()
                if self._closing:
                    return
                await asyncio.sleep(backoff)
            except Exception:  # keep draining whatever happens to one batch
                log.exception("gateway writer: unexpected error; retrying the batch")
                await asyncio.sleep(1.0)

    def _read(self) -> tuple[list[Record], _Decoded]:
        records = self.spool.read(BATCH)
        return records, self._decode(records)

    async def drain(self, records: list[Record]) -> None:
        """Store ``records`` and move the spool's cursor past them."""
        await self._store(records, await asyncio.to_thread(self._decode, records))

    async def _store(self, records: list[Record], decoded: _Decoded) -> None:
        if decoded.rows:
            await self._insert(decoded)
        size = sum(record.size for record in records)
        await asyncio.to_thread(self.spool.commit, records[-1].end, size)
        self.stored += len(decoded.rows)
        GATEWAY_STORED.inc(len(decoded.rows))

    @staticmethod
    def _decode(records: list[Record]) -> _Decoded:
        decoded = _Decoded([], [])
        for record in records:
            try:
                call = CapturedCall.decode(record.payload)
                decoded.rows.append(call_row(call))
                decoded.loops.append(call.loop)
            except (ValueError, TypeError) as exc:
                log.error("gateway writer: a spool record cannot be read (%s); skipped", exc)
                GATEWAY_DROPPED.labels("-", "spool_corrupt").inc()
        return decoded

    async def _insert(self, decoded: _Decoded) -> None:
        connection = await self._connect()
        try:
            async with connection.transaction(), connection.cursor() as cursor:
                await cursor.executemany(INSERT_CALL_SQL, decoded.rows)
        except _ROW_ERRORS:
            await self._insert_one_by_one(connection, decoded)
        await self._confirm(connection, decoded)

    async def _confirm(self, connection: psycopg.AsyncConnection[Any], decoded: _Decoded) -> None:
        """Ask Postgres, after the commit, that it holds every call of the batch (refused
        rows aside) before the cursor moves: a commit whose answer was lost with the
        connection, or anything else that loses a row quietly, becomes a retry, never a
        loss."""
        ids = [row[1] for row in decoded.rows]
        cursor = await connection.execute(
            "SELECT count(*) FROM gateway_calls WHERE call_id = ANY(%s)", (ids,)
        )
        found = await cursor.fetchone()
        held = int(found[0]) if found is not None else 0
        if held < len(ids) - decoded.refused:
            raise psycopg.OperationalError(
                f"Postgres holds {held} of the batch's {len(ids)} calls after the commit"
            )

    async def _insert_one_by_one(
        self, connection: psycopg.AsyncConnection[Any], decoded: _Decoded
    ) -> None:
        for row, loop in zip(decoded.rows, decoded.loops, strict=True):
            try:
                async with connection.transaction():
                    await connection.execute(INSERT_CALL_SQL, row)
            except _ROW_ERRORS as exc:
                log.error("gateway writer: Postgres refused call %s (%s); skipped", row[1], exc)
                GATEWAY_DROPPED.labels(loop, "refused").inc()
                decoded.refused += 1

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._connection is None or self._connection.closed or self._connection.broken:
            self._connection = await psycopg.AsyncConnection.connect(
                self._conninfo,
                autocommit=True,
                application_name="ratchet-gateway",
                connect_timeout=5,
            )
            self.connected = True
        return self._connection

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.close()
            except Exception:
                log.debug("gateway writer: closing a broken connection failed", exc_info=True)

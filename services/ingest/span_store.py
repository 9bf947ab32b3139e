"""OTLP episodes assembled from spans that wait durably in Postgres, and the quiet-period sweeper.

An export is handled in one transaction. It first locks the queue rows of its traces in
``otlp_pending_traces`` (creating them) and reads what is stored for those traces in
``otlp_spans``; the rules of services.ingest.episodes then run over the stored rows plus the
export's; the episodes they call complete are mapped (services.ingest.otlp_mapping) and written
through the ingest writer like webhook traces; finally the export's rows are inserted (those
of the episodes just written already marked assembled, without their payload; the rest
waiting, with it), the stored rows that were used are marked assembled, and the transaction
commits. Only then is the export answered.

Why this is safe:

- A 2xx means the export's spans are in Postgres. If the writer is full or down, the
  episodes' rows are stored as waiting and the sweeper assembles them after the quiet
  period; if the commit fails, the export is answered 503 and retried.
- An episode's external id comes from its span, so assembling it twice (a retry after a
  failed commit, a crash between writing the trace and committing) stores it once: the
  second write is a duplicate.
- Concurrent exports of one trace (a Collector's consumers, replicas behind a load
  balancer) queue on the trace's row lock, held from the first read to the commit, so the
  second sees everything the first stored. Every writer takes the queue rows first and in
  trace id order, so the two paths cannot deadlock.

The sweeper runs in every api process, not as a Temporal activity: the api owns the ingest
writer and this module already, ingest must keep working while Temporal is down (a webhook
that needs the workflow engine to store traces couples two outages), and a quiet period of
seconds is a poor fit for a schedule. Replicas share the work through the queue: each claims
quiet traces with ``FOR UPDATE SKIP LOCKED`` and a lease, so no two assemble the same trace at
once, and a replica that dies mid-way leaves its claims to the others when the lease ends.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from services.db.queries import otlp_spans as queries
from services.db.session import SessionFactory
from services.ingest.episodes import LOG, OTHER, Episode, Node, Plan, plan_trace
from services.ingest.errors import IngestError
from services.ingest.otlp import DecodedExport, LogView, SpanView
from services.ingest.otlp_mapping import (
    MappingError,
    apply_logs,
    external_id_of,
    validate_episode,
)
from services.ingest.schema import StoredTrace
from services.ingest.service import IngestService
from services.ingest.writer import StorageUnavailable, WriteStatus
from services.metrics import INGEST_REJECTED
from services.settings import Settings

log = logging.getLogger(__name__)

SOURCE = "otlp"
INSERT_CHUNK = 1_000  # rows per INSERT (Postgres takes at most 65,535 parameters)
WRITE_CHUNK = 100  # traces per call to the writer, so one call always fits its queue
SWEEP_CLAIM = 200  # traces claimed per sweep round
PURGE_EVERY_S = 60.0
PURGE_LIMIT = 10_000

T = TypeVar("T")


@dataclass
class AssemblyReport:
    """What became of an export's new rows: how many were rejected, and why."""

    rejected: int = 0
    errors: list[str] = field(default_factory=list)
    stored_traces: int = 0


@dataclass
class _Outcome:
    done: list[int] = field(default_factory=list)  # row ids to mark assembled
    dropped: list[int] = field(default_factory=list)  # row ids to delete
    rejected: list[tuple[str, list[Node], str]] = field(default_factory=list)  # trace, rows, why
    stored: int = 0


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _node(row: tuple[Any, ...]) -> tuple[str, Node]:
    trace_id, row_id, record_id, span_id, parent, kind, remote, has_content, assembled = row
    return trace_id, Node(
        row_id, record_id, span_id, parent, kind, remote, bool(has_content), bool(assembled)
    )


class EpisodeAssembler:
    """See the module docstring."""

    def __init__(self, *, settings: Settings, session_factory: SessionFactory) -> None:
        self.settings = settings
        self._session_factory = session_factory
        self._last_purge = 0.0
        # Each export holds a pooled connection from its first read to its commit (across the
        # trace write): at most half the pool at once, so OTLP floods cannot starve the rest of
        # the api (credentials, admin API) of connections.
        self._transactions = asyncio.Semaphore(max(1, settings.database_pool_size // 2))

    @property
    def sweep_interval_s(self) -> float:
        return max(0.05, min(5.0, self.settings.otlp_episode_quiet_s / 4))

    # Postgres, in a worker thread ---------------------------------------------------------

    async def _db(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(work, *args)
        except (OperationalError, InterfaceError, PoolTimeout) as exc:
            raise StorageUnavailable(
                f"Postgres is unavailable ({type(exc).__name__}); nothing was acknowledged"
            ) from exc
        except IntegrityError:
            raise IngestError(
                409, "loop_gone", "the loop was deleted while its spans were being stored"
            ) from None

    def _lock_and_read(
        self, session: Session, loop_id: int, trace_ids: set[str]
    ) -> list[tuple[Any, ...]]:
        """Open the request's transaction: lock the traces' queue rows, read what is stored."""
        queries.touch_pending_traces(session=session, loop_id=loop_id, trace_ids=trace_ids)
        return queries.trace_structure(session=session, loop_id=loop_id, trace_ids=trace_ids)

    def _store_and_finish(
        self,
        session: Session,
        loop_id: int,
        fresh: list[dict[str, Any]],
        outcome: _Outcome,
        trace_ids: set[str],
    ) -> None:
        """Close the request's transaction: store its new rows (as waiting, or already
        assembled without their payload), mark and drop the stored ones, commit."""
        done, dropped = set(outcome.done), set(outcome.dropped)
        now = dt.datetime.now(dt.UTC)
        inserts: list[dict[str, Any]] = []
        for number, row in enumerate(fresh):
            row_id = _fresh_id(number)
            if row_id in dropped:
                continue
            if row_id in done:
                inserts.append({**row, "payload": None, "assembled_at": now})
            else:
                inserts.append({**row, "assembled_at": None})
        for chunk in _chunks(inserts, INSERT_CHUNK):
            queries.insert_rows(session=session, rows=chunk)
        queries.mark_assembled(session=session, row_ids=[i for i in done if i > 0])
        queries.delete_rows(session=session, row_ids=[i for i in dropped if i > 0])
        queries.release_traces(session=session, loop_id=loop_id, trace_ids=trace_ids)
        session.commit()

    def _read(self, loop_id: int, trace_ids: set[str]) -> list[tuple[Any, ...]]:
        with self._session_factory() as session:
            return queries.trace_structure(session=session, loop_id=loop_id, trace_ids=trace_ids)

    def _payloads(self, row_ids: list[int]) -> dict[int, str | None]:
        with self._session_factory() as session:
            return queries.payloads(session=session, row_ids=row_ids)

    def _finish(
        self,
        loop_id: int,
        row_ids: list[int],
        dropped: list[int],
        trace_ids: set[str],
        unclaim: bool,
    ) -> None:
        with self._session_factory.begin() as session:
            # The queue rows first, as the request path takes them: no deadlock between them.
            queries.lock_pending_traces(session=session, loop_id=loop_id, trace_ids=trace_ids)
            queries.mark_assembled(session=session, row_ids=row_ids)
            queries.delete_rows(session=session, row_ids=dropped)
            queries.release_traces(
                session=session, loop_id=loop_id, trace_ids=trace_ids, unclaim=unclaim
            )

    # The request path ---------------------------------------------------------------------

    async def ingest(
        self, service: IngestService, *, loop_id: int, loop_name: str, decoded: DecodedExport
    ) -> AssemblyReport:
        """Assemble what this export completes and store the rest of it, in one transaction
        that holds the traces' queue rows from the first read to the commit.

        Raises :class:`StorageUnavailable` unless the export's rows were committed (then
        nothing may be acknowledged; traces already written come back as duplicates on the
        retry). Shielded: a client that hangs up does not cut the transaction short (its
        session is in use in a worker thread).
        """
        task = asyncio.ensure_future(self._ingest(service, loop_id, loop_name, decoded))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(task)

    async def _ingest(
        self, service: IngestService, loop_id: int, loop_name: str, decoded: DecodedExport
    ) -> AssemblyReport:
        rows = _rows(loop_id, decoded)
        if not rows:
            return AssemblyReport()
        trace_ids = {row["trace_id"] for row in rows}
        async with self._transactions:
            return await self._ingest_rows(service, loop_id, loop_name, rows, trace_ids)

    async def _ingest_rows(
        self,
        service: IngestService,
        loop_id: int,
        loop_name: str,
        rows: list[dict[str, Any]],
        trace_ids: set[str],
    ) -> AssemblyReport:
        session = self._session_factory()
        try:
            structure = await self._db(self._lock_and_read, session, loop_id, trace_ids)
            stored = {(row[0], row[2]) for row in structure}
            fresh = [r for r in rows if (r["trace_id"], r["record_id"]) not in stored]
            plans = _plans([*structure, *(_fresh_row(n, r) for n, r in enumerate(fresh))])
            known = {(r["trace_id"], r["record_id"]): r["payload"] for r in rows}

            async def finish(outcome: _Outcome, written: bool) -> None:
                await self._db(self._store_and_finish, session, loop_id, fresh, outcome, trace_ids)

            report = AssemblyReport()
            new = {(r["trace_id"], r["record_id"]) for r in fresh}
            await self._assemble(service, loop_id, loop_name, plans, new, report, known, finish)
            return report
        finally:
            await asyncio.to_thread(session.close)  # rolls back unless committed

    # The sweeper --------------------------------------------------------------------------

    async def sweep_once(self, service: IngestService) -> int:
        """Assemble traces that have been quiet for the quiet period; how many were claimed
        and handled (0 when the writer refused some: they wait for their lease to end)."""
        settings = self.settings
        lease_s = max(60.0, 4 * settings.otlp_episode_quiet_s)

        def claim() -> list[tuple[int, str, str]]:
            with self._session_factory.begin() as session:
                return queries.claim_quiet_traces(
                    session=session,
                    quiet_s=settings.otlp_episode_quiet_s,
                    max_wait_s=settings.otlp_episode_max_wait_s,
                    lease_s=lease_s,
                    limit=SWEEP_CLAIM,
                )

        claims = await self._db(claim)
        written = True
        by_loop: dict[tuple[int, str], set[str]] = defaultdict(set)
        for loop_id, loop_name, trace_id in claims:
            by_loop[(loop_id, loop_name)].add(trace_id)
        for (loop_id, loop_name), trace_ids in by_loop.items():
            structure = await self._db(self._read, loop_id, trace_ids)
            plans = _plans(structure, flush=True)
            for trace_id in trace_ids:
                plans.setdefault(trace_id, Plan())

            async def finish(
                outcome: _Outcome,
                written: bool,
                loop_id: int = loop_id,
                traces: set[str] = trace_ids,
            ) -> None:
                try:
                    await self._db(
                        self._finish, loop_id, outcome.done, outcome.dropped, traces, written
                    )
                except StorageUnavailable as exc:  # the lease ends; the next sweep redoes them
                    log.warning("otlp sweeper: assembled rows not marked: %s", exc)

            report = AssemblyReport()
            written &= await self._assemble(
                service, loop_id, loop_name, plans, None, report, {}, finish
            )
            if report.errors:
                log.warning(
                    "otlp: %d episode(s) of loop %s could not be stored after the quiet period: %s",
                    len(report.errors),
                    loop_name,
                    "; ".join(report.errors[:5]),
                )
        await self._purge()
        # When the writer refused, the claims stay leased (retried when the lease ends), and
        # the caller must not sweep again at once.
        return len(claims) if written else 0

    async def _purge(self) -> None:
        if time.monotonic() - self._last_purge < PURGE_EVERY_S:
            return
        self._last_purge = time.monotonic()
        retention = float(self.settings.otlp_span_retention_s)

        def purge() -> int:
            with self._session_factory.begin() as session:
                return queries.purge_assembled(
                    session=session, retention_s=retention, limit=PURGE_LIMIT
                )

        await self._db(purge)

    async def run_sweeper(self, current_service: Callable[[], IngestService | None]) -> None:
        """Sweep forever (until cancelled); errors are logged and the next round retries."""
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            service = current_service()
            if service is None or not service.writer.running:
                continue
            try:
                while await self.sweep_once(service) >= SWEEP_CLAIM:
                    pass
            except StorageUnavailable as exc:
                log.warning("otlp sweeper: %s; retrying in %.1fs", exc, self.sweep_interval_s)
            except Exception:  # keep sweeping whatever one round hit
                log.exception("otlp sweeper: unexpected error; retrying")

    # Assembly, shared by both paths -------------------------------------------------------

    async def _assemble(
        self,
        service: IngestService,
        loop_id: int,
        loop_name: str,
        plans: dict[str, Plan],
        new: set[tuple[str, str]] | None,
        report: AssemblyReport,
        known: dict[tuple[str, str], str | None],
        finish: Callable[[_Outcome, bool], Awaitable[None]],
    ) -> bool:
        """Assemble what ``plans`` call complete; False when the writer refused (the
        episodes keep waiting)."""
        outcome = _Outcome()
        written = True
        episodes: list[tuple[str, Episode]] = []
        for trace_id, plan in plans.items():
            episodes.extend((trace_id, episode) for episode in plan.episodes)
            outcome.done.extend(n.row_id for n in plan.context)
            for members in plan.unmapped:
                # Plain application traces: kept no longer than it takes to say so.
                outcome.dropped.extend(n.row_id for n in members)
                outcome.rejected.append(
                    (
                        trace_id,
                        members,
                        f"trace {trace_id}: no gen_ai spans (nothing to learn from)",
                    )
                )
            if plan.late:
                outcome.done.extend(n.row_id for n in plan.late)
                outcome.rejected.append(
                    (trace_id, plan.late, f"trace {trace_id}: arrived after its episode was stored")
                )
        stored = await self._map(episodes, outcome, known)
        try:
            # Never more than the queue holds: an export bigger than the queue still fits.
            size = max(1, min(WRITE_CHUNK, self.settings.ingest_queue_max))
            for chunk in _chunks(stored, size):
                results = await service.store(
                    loop_id=loop_id,
                    loop_name=loop_name,
                    source=SOURCE,
                    traces=[(index, trace) for index, (_, _, trace) in enumerate(chunk)],
                    rejected=[],
                    total=len(chunk),
                )
                for (trace_id, episode, _), result in zip(chunk, results, strict=True):
                    outcome.done.extend(n.row_id for n in episode.rows)
                    if result.status == WriteStatus.REJECTED:
                        outcome.rejected.append(
                            (trace_id, episode.rows, f"trace {result.external_id}: {result.reason}")
                        )
                    else:
                        outcome.stored += 1
        except StorageUnavailable as exc:
            # The rows are (or are about to be) stored: the sweeper assembles these episodes
            # when the writer is back.
            log.warning("otlp: episodes left for the sweeper: %s", exc)
            written = False
        await finish(outcome, written)
        report.stored_traces += outcome.stored
        for trace_id, nodes, reason in outcome.rejected:
            # A request reports only its own rows; the sweeper counts everything it drops.
            counted = [n for n in nodes if new is None or (trace_id, n.record_id) in new]
            if counted:
                report.rejected += len(counted)
                report.errors.append(reason)
                INGEST_REJECTED.labels(loop_name, SOURCE, "unassembled_spans").inc(len(counted))
        return written

    async def _map(
        self,
        episodes: list[tuple[str, Episode]],
        outcome: _Outcome,
        known: dict[tuple[str, str], str | None],
    ) -> list[tuple[str, Episode, StoredTrace]]:
        if not episodes:
            return []
        unread = [
            n.row_id
            for trace_id, episode in episodes
            for n in episode.rows
            if n.row_id > 0 and known.get((trace_id, n.record_id)) is None
        ]
        read = await self._db(self._payloads, unread) if unread else {}

        def payload(trace_id: str, node: Node) -> str | None:
            return known.get((trace_id, node.record_id)) or read.get(node.row_id)

        stored: list[tuple[str, Episode, StoredTrace]] = []
        for trace_id, episode in episodes:
            spans = [
                SpanView.from_payload(trace_id, n.span_id, n.parent_span_id, text)
                for n in episode.spans
                if (text := payload(trace_id, n)) is not None
            ]
            logs = [
                LogView.from_payload(trace_id, n.span_id, text)
                for n in episode.logs
                if (text := payload(trace_id, n)) is not None
            ]
            agent = None
            if episode.agent is not None:
                agent = next((s for s in spans if s.span_id == episode.agent.span_id), None)
                if agent is None:  # assembled meanwhile by another replica: nothing left
                    continue
            apply_logs(spans, logs)
            external_id = external_id_of(
                trace_id, episode.key_span_id, key_is_root=episode.key_is_root
            )
            try:
                trace = validate_episode(trace_id, agent, spans, external_id=external_id)
                stored.append((trace_id, episode, trace))
            except MappingError as exc:
                outcome.done.extend(n.row_id for n in episode.rows)
                outcome.rejected.append((trace_id, episode.rows, str(exc)))
        return stored


def _fresh_id(number: int) -> int:
    """The stand-in row id of an export's ``number``-th new row (not yet in Postgres)."""
    return -(number + 1)


def _fresh_row(number: int, row: dict[str, Any]) -> tuple[Any, ...]:
    """A new row as ``trace_structure`` would return it."""
    return (
        row["trace_id"],
        _fresh_id(number),
        row["record_id"],
        row["span_id"],
        row["parent_span_id"],
        row["kind"],
        row["remote_parent"],
        row["has_content"],
        False,
    )


def _plans(structure: list[tuple[Any, ...]], *, flush: bool = False) -> dict[str, Plan]:
    nodes: dict[str, list[Node]] = defaultdict(list)
    for row in structure:
        trace_id, node = _node(row)
        nodes[trace_id].append(node)
    return {trace_id: plan_trace(items, flush=flush) for trace_id, items in nodes.items()}


def _rows(loop_id: int, decoded: DecodedExport) -> list[dict[str, Any]]:
    """The export's rows, once each (an export may hold the same span twice)."""
    rows: list[dict[str, Any]] = []
    for trace_id, spans in decoded.spans.items():
        for span in spans:
            kind = span.kind
            rows.append(
                {
                    "loop_id": loop_id,
                    "trace_id": trace_id,
                    "record_id": span.span_id,
                    "span_id": span.span_id,
                    "parent_span_id": span.parent_span_id,
                    "kind": kind,
                    "remote_parent": span.remote_parent,
                    "has_content": span.has_content,
                    # Context spans only matter for the structure.
                    "payload": None if kind == OTHER else span.to_payload(),
                }
            )
    for trace_id, logs in decoded.logs.items():
        for record in logs:
            rows.append(
                {
                    "loop_id": loop_id,
                    "trace_id": trace_id,
                    "record_id": record.record_id,
                    "span_id": record.span_id,
                    "parent_span_id": "",
                    "kind": LOG,
                    "remote_parent": None,
                    "has_content": record.has_content,
                    "payload": record.to_payload(),
                }
            )
    unique = {(row["trace_id"], row["record_id"]): row for row in rows}
    return list(unique.values())

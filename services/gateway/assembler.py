"""Sessions assembled downstream, in Postgres: calls placed, idle sessions closed into traces,
outcomes joined.

Every gateway replica runs :meth:`Assembler.run`; a loop is assembled by one of them at a
time (a transaction-scoped advisory lock per loop, tried without waiting), so no replica
holds session state and any may die. A pass over a loop, in one transaction:

1. **Place** its new calls, oldest first (by the time the gateway captured them, whichever
   replica did): a call that names a session joins the open session of that key (or opens
   it); else it continues the open session whose last call's conversation its messages
   extend (services.gateway.conversation's digests; the longest such), else it opens one
   keyed ``call-<its id>``.
2. **Join** outcomes that name a session not yet known.
3. **Close** sessions idle for ``RATCHET_GATEWAY_SESSION_IDLE_S``: the session's calls
   become one trace (services.gateway.sessions), stored as any trace is (``source``
   ``gateway``), so curation takes it up as it does every trace.
4. **Apply** joined outcomes of closed sessions as feedback on their traces, which sends a
   curated trace back to curation (as ``POST .../traces/{id}/feedback`` does).

The api's close (``POST /v1/loops/{loop}/sessions/{id}/close``) runs the same steps for the
loop first, under the same lock, then closes the named session.

A session closes by its idle time as Postgres sees the calls: calls still in a replica's
spool (Postgres was down for longer than the idle time) start a new session when they are
drained after their session closed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from services.db.models import GatewayCall, GatewayOutcome, GatewaySession
from services.db.queries.traces import add_feedback
from services.db.session import SessionFactory
from services.gateway import queries
from services.gateway.capture import COMPLETION
from services.gateway.conversation import text_digest
from services.gateway.sessions import OutcomeFields, StoredCall, build_trace
from services.ingest.errors import IngestError
from services.ingest.schema import validate_trace
from services.metrics import GATEWAY_SESSIONS_CLOSED

log = logging.getLogger(__name__)

PLACE_LIMIT = 2_000
CLOSE_LIMIT = 200


@dataclass
class PassReport:
    """What one pass over a loop did."""

    placed: int = 0
    closed: list[int] = field(default_factory=list)
    applied: int = 0


def place_calls(session: Session, *, loop_id: int) -> int:
    """Step 1 (see the module docstring); the number of calls placed.

    The open sessions a batch of calls can join are read once (by the batch's session keys
    and conversation digests) and kept in memory as calls join and open them, so a batch is
    a few statements, not three round trips per call through the ORM's flush (which took
    more of the gateway's CPU than answering the calls). Text completions, rare, still ask
    Postgres call by call (the lengths their prompts are cut at change as they are placed).
    """
    calls = queries.unplaced_calls(session=session, loop_id=loop_id, limit=PLACE_LIMIT)
    if not calls:
        return 0
    open_ = _OpenSessions.read(session, loop_id, calls)
    placed: list[tuple[GatewayCall, GatewaySession]] = []
    for call in calls:
        if call.kind == COMPLETION:
            session.flush()
            row = _session_for(session, loop_id, call)
        else:
            row = open_.find(call) or open_.new(session, loop_id, call)
        if not row.call_count:
            open_.opened(row)
        before = row.last_after_hash
        row.call_count = (row.call_count or 0) + 1
        row.last_after_hash = call.after_hash
        row.last_call_at = max(row.last_call_at, call.captured_at)
        if call.kind == COMPLETION:
            prompt = call.body.get("prompt")
            reply = (call.body.get("reply") or {}).get("content") or ""
            row.last_after_chars = len(prompt) + len(reply) if isinstance(prompt, str) else None
        open_.moved(row, before)
        placed.append((call, row))
    session.flush()  # new sessions get their ids
    for call, row in placed:
        call.session_id = row.id
    session.flush()
    return len(calls)


class _OpenSessions:
    """The loop's open sessions a batch of calls may join, by key and by the digest their
    last call ended at, kept current as the batch is placed."""

    def __init__(self, rows: Sequence[GatewaySession]) -> None:
        self._by_key: dict[str, GatewaySession] = {}
        self._by_after: dict[str, list[GatewaySession]] = {}
        self._created: dict[int, int] = {}  # id(row) -> the order this batch opened it in
        for row in rows:
            self.moved(row, None)

    @classmethod
    def read(cls, session: Session, loop_id: int, calls: Sequence[GatewayCall]) -> _OpenSessions:
        keys = {call.session_key for call in calls if call.session_key}
        digests = {
            digest for call in calls if call.kind != COMPLETION for digest in call.prefix_hashes
        }
        by_key = queries.open_sessions_by_keys(session=session, loop_id=loop_id, keys=keys)
        ending = queries.open_sessions_ending_in(session=session, loop_id=loop_id, digests=digests)
        return cls([*by_key, *ending])

    def moved(self, row: GatewaySession, before: str | None) -> None:
        """``row`` (new, or its last call's digest was ``before``) as it is now."""
        self._by_key[row.key] = row
        if before is not None and before != row.last_after_hash:
            ending = self._by_after.get(before, [])
            if row in ending:
                ending.remove(row)
        if row.last_after_hash is not None:
            ending = self._by_after.setdefault(row.last_after_hash, [])
            if row not in ending:
                ending.append(row)

    def find(self, call: GatewayCall) -> GatewaySession | None:
        """As :func:`_session_for` finds it, without asking Postgres."""
        if call.session_key:
            return self._by_key.get(call.session_key)
        digests = list(reversed(call.prefix_hashes))  # the longest conversation first
        rank = {digest: index for index, digest in enumerate(digests)}
        found = [
            row for digest in digests for row in self._by_after.get(digest, ()) if not row.explicit
        ]
        if not found:
            return None
        return min(found, key=lambda row: (rank[row.last_after_hash or ""], self._order(row)))

    def new(self, session: Session, loop_id: int, call: GatewayCall) -> GatewaySession:
        row = queries.new_session(
            session=session,
            loop_id=loop_id,
            key=call.session_key or f"call-{call.call_id}",
            explicit=bool(call.session_key),
            at=call.started_at,
            flush=False,
        )
        return row

    def opened(self, row: GatewaySession) -> None:
        """``row`` was opened by this batch (its id may come only when it is flushed)."""
        self._created.setdefault(id(row), len(self._created))

    def _order(self, row: GatewaySession) -> tuple[int, int]:
        """Sessions by id, as :func:`_continued` orders them: those opened by this batch
        after the others, in the order they were opened."""
        if id(row) in self._created:
            return (1, self._created[id(row)])
        return (0, row.id)


def _session_for(session: Session, loop_id: int, call: GatewayCall) -> GatewaySession:
    if call.session_key:
        found = queries.open_session_by_key(session=session, loop_id=loop_id, key=call.session_key)
        return found or queries.new_session(
            session=session,
            loop_id=loop_id,
            key=call.session_key,
            explicit=True,
            at=call.started_at,
        )
    continued = _continued(session, loop_id, call)
    if continued is not None:
        return continued
    return queries.new_session(
        session=session,
        loop_id=loop_id,
        key=f"call-{call.call_id}",
        explicit=False,
        at=call.started_at,
    )


def _continued(session: Session, loop_id: int, call: GatewayCall) -> GatewaySession | None:
    """The open session (not named by the agent) this call's conversation extends."""
    if call.kind == COMPLETION:
        prompt = call.body.get("prompt")
        if not isinstance(prompt, str):
            return None
        lengths = queries.open_text_lengths(session=session, loop_id=loop_id)
        digests = [text_digest(prompt[:n]) for n in lengths if 0 < n <= len(prompt)]
    else:
        digests = list(reversed(call.prefix_hashes))  # the longest conversation first
    found = [
        row
        for row in queries.open_sessions_ending_in(
            session=session, loop_id=loop_id, digests=digests
        )
        if not row.explicit
    ]
    if not found:
        return None
    rank = {digest: index for index, digest in enumerate(digests)}
    return min(found, key=lambda row: (rank.get(row.last_after_hash or "", len(rank)), row.id))


def resolve_outcomes(session: Session, *, loop_id: int) -> list[GatewayOutcome]:
    """Step 2: give each waiting outcome its session, where one can be found now."""
    waiting = list(queries.waiting_outcomes(session=session, loop_id=loop_id))
    for outcome in waiting:
        if outcome.session_id is None:
            found = queries.session_for_ref(
                session=session, loop_id=loop_id, ref=outcome.session_ref
            )
            if found is not None:
                outcome.session_id = found.id
    session.flush()
    return waiting


def close_session(session: Session, row: GatewaySession, *, reason: str) -> int | None:
    """Close one session into its trace; the trace's row id (None for a session without
    calls, or whose trace the schema refuses: logged)."""
    calls = [
        StoredCall(
            c.call_id, c.kind, c.started_at, c.captured_at, c.model_version, c.response_id, c.body
        )
        for c in queries.session_calls(session=session, session_id=row.id)
    ]
    outcomes = [
        o
        for o in queries.waiting_outcomes(session=session, loop_id=row.loop_id)
        if o.session_id == row.id
    ]
    trace_id = None
    if calls:
        document = build_trace(
            session_id=row.id,
            key=row.key,
            explicit=row.explicit,
            calls=calls,
            outcome=_latest(outcomes),
            close_reason=reason,
        )
        trace_id = _store(session, row, document)
    queries.mark_closed(session=session, row=row, reason=reason, trace_id=trace_id)
    row.status, row.trace_id = queries.CLOSED, trace_id
    if trace_id is not None:
        for outcome in outcomes:
            apply_outcome(session, outcome, trace_id=trace_id)
    GATEWAY_SESSIONS_CLOSED.labels(str(row.loop_id), reason).inc()
    return trace_id


def _store(session: Session, row: GatewaySession, document: dict[str, object]) -> int | None:
    try:
        stored = validate_trace(document)
    except IngestError as exc:
        log.error("gateway: session %s does not make a valid trace: %s %s", row.id, exc, exc.fields)
        return None
    values = {
        "external_id": stored.external_id,
        "model_version": stored.model_version,
        "success": stored.success,
        "score": stored.score,
        "error_kind": stored.error_kind,
        "body": json.loads(stored.body_json),
        "size_bytes": stored.size_bytes,
        "started_at": stored.started_at,
        "ended_at": stored.ended_at,
    }
    return queries.insert_trace(session=session, loop_id=row.loop_id, values=values)


def _latest(outcomes: list[GatewayOutcome]) -> OutcomeFields | None:
    if not outcomes:
        return None
    newest = outcomes[-1]
    return OutcomeFields(newest.success, newest.score, newest.reference_answer, newest.label)


def apply_outcome(session: Session, outcome: GatewayOutcome, *, trace_id: int) -> None:
    """An outcome on its session's trace, as feedback (which re-curates a curated trace):
    its score (else 1 for success, 0 for failure), label, and reference answer as the
    correction."""
    score = outcome.score
    if score is None and outcome.success is not None:
        score = 1.0 if outcome.success else 0.0
    digest = hashlib.sha256(f"gateway-outcome:{outcome.id}".encode()).hexdigest()
    feedback_id, _ = add_feedback(
        session=session,
        loop_id=outcome.loop_id,
        trace_id=trace_id,
        score=score,
        label=outcome.label,
        correction=outcome.reference_answer,
        comment=None,
        content_hash=digest,
    )
    outcome.feedback_id = feedback_id
    session.flush()


def assemble_loop(session: Session, *, loop_id: int, now: dt.datetime, idle_s: float) -> PassReport:
    """One pass over a loop (the caller holds its lock and owns the transaction)."""
    report = PassReport(placed=place_calls(session, loop_id=loop_id))
    waiting = resolve_outcomes(session, loop_id=loop_id)
    idle_before = now - dt.timedelta(seconds=idle_s)
    for row in queries.idle_sessions(
        session=session, loop_id=loop_id, idle_before=idle_before, limit=CLOSE_LIMIT
    ):
        close_session(session, row, reason="idle")
        report.closed.append(row.id)
    for outcome in waiting:
        if outcome.feedback_id is not None or outcome.session_id is None:
            continue
        closed = session.get(GatewaySession, outcome.session_id)
        if closed is not None and closed.trace_id is not None:
            apply_outcome(session, outcome, trace_id=closed.trace_id)
            report.applied += 1
    return report


class Assembler:
    """Runs :func:`assemble_loop` over every loop with work, every ``interval_s``."""

    def __init__(
        self, session_factory: SessionFactory, *, idle_s: float, interval_s: float = 1.0
    ) -> None:
        self._session_factory = session_factory
        self._idle_s = idle_s
        self._interval_s = interval_s

    def run_once(self, now: dt.datetime | None = None) -> dict[int, PassReport]:
        now = now or dt.datetime.now(dt.UTC)
        idle_before = now - dt.timedelta(seconds=self._idle_s)
        with self._session_factory() as session:
            loops = queries.loops_with_work(session=session, idle_before=idle_before)
        reports = {}
        for loop_id in loops:
            with self._session_factory.begin() as session:
                if queries.try_lock_loop(session=session, loop_id=loop_id):
                    reports[loop_id] = assemble_loop(
                        session, loop_id=loop_id, now=now, idle_s=self._idle_s
                    )
        return reports

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.run_once)
            except SQLAlchemyError as exc:
                log.warning("gateway assembler: Postgres unavailable (%s)", type(exc).__name__)
            except Exception:
                log.exception("gateway assembler: a pass failed")
            await asyncio.sleep(self._interval_s)

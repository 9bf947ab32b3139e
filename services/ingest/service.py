"""The ingest service the two doors share: authentication, storage, per-item outcomes, metrics.

The api builds one per process (in the traces route module's startup hook) around a
:class:`GroupCommitWriter` and a :class:`CredentialCache`; the routes stay thin: read the
body within limits, call in here, write the answer.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import Engine

from services.db.session import SessionFactory
from services.ingest.credentials import CredentialCache, IngestLoop, LoopKeys, TokenLoop
from services.ingest.errors import IngestError
from services.ingest.schema import Rejection, StoredTrace
from services.ingest.signature import SignatureError, SignedHeaders, parse_headers, verify
from services.ingest.warnings import TraceWarning
from services.ingest.writer import GroupCommitWriter, StorageUnavailable, TraceRow, WriteStatus
from services.loop.states import LoopLifecycle
from services.metrics import (
    INGEST_ACCEPTED,
    INGEST_BYTES,
    INGEST_DUPLICATE,
    INGEST_RECEIVED,
    INGEST_REJECTED,
)
from services.secrets import SecretBox
from services.settings import Settings

LOOP_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
UNKNOWN_LOOP = "-"  # metric label for requests whose loop is not known
_DECOY_KEY = b"\0" * 32  # verified against for an unknown loop, so it costs the same HMAC


# Not frozen: a frozen dataclass's __init__ costs ~3x (object.__setattr__ per field), and
# one of these is built per trace on the ingest hot path. Treat instances as read-only.
@dataclass(slots=True)
class ItemOutcome:
    """The answer for one item of a request."""

    index: int
    external_id: str | None
    status: WriteStatus
    trace_id: int | None = None
    reason: str | None = None
    fields: list[dict[str, str]] = field(default_factory=list)
    warnings: tuple[TraceWarning, ...] = ()


def conninfo_from_engine(engine: Engine) -> str:
    """A libpq connection string for the same database as the SQLAlchemy engine."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def _unauthorized(message: str, scheme: str) -> IngestError:
    return IngestError(401, "unauthorized", message, headers={"WWW-Authenticate": scheme})


class IngestService:
    """See the module docstring."""

    def __init__(
        self, *, settings: Settings, session_factory: SessionFactory, conninfo: str
    ) -> None:
        self.settings = settings
        self.writer = GroupCommitWriter(
            conninfo,
            queue_max=settings.ingest_queue_max,
            max_rows=settings.ingest_commit_max_rows,
            max_wait_s=settings.ingest_commit_max_wait_ms / 1000.0,
        )
        self.credentials = CredentialCache(session_factory, box=SecretBox.from_settings(settings))

    async def start(self) -> None:
        await self.writer.start()

    async def stop(self) -> None:
        await self.writer.stop()

    # Authentication -----------------------------------------------------------------------

    async def webhook_loop(self, name: str) -> LoopKeys | None:
        """The loop a webhook path names, None when there is none.

        No answer says which: an unknown loop fails the signature check like a wrong secret
        (401), so the webhook cannot be used to find out which loop names exist.
        """
        return await self.credentials.loop_keys(name) if LOOP_NAME.match(name) else None

    @staticmethod
    def check_accepts_traces(loop: IngestLoop) -> None:
        """409 for an archived loop (told only to a sender that proved it holds a secret or
        a token)."""
        if loop.status == LoopLifecycle.ARCHIVED:
            raise IngestError(
                409, "loop_archived", f"loop {loop.name!r} is archived and takes no traces"
            )

    def signed_headers(self, headers: Mapping[str, str]) -> SignedHeaders:
        """The signature headers, checked for form and freshness before the body is read."""
        try:
            return parse_headers(
                headers,
                now=time.time(),
                tolerance_s=self.settings.ingest_timestamp_tolerance_s,
            )
        except SignatureError as exc:
            raise _unauthorized(str(exc), "Webhook-Signature") from None

    async def verify_signature(
        self, keys: LoopKeys | None, signed: SignedHeaders, body: bytes
    ) -> LoopKeys:
        """The loop, or 401 unless a signature matches under one of its active secrets.

        On a miss the loop's secrets are re-read once (a rotation may have happened in another
        api process) before the request is refused. An unknown loop (``None``) is refused with
        the same answer after the same work, so the two cannot be told apart.
        """
        now = dt.datetime.now(dt.UTC)
        if keys is not None:
            if verify(signed, body, keys.active(now)):
                return keys
            fresh = await self.credentials.refresh_loop_keys(keys.name)
            if (
                fresh is not None
                and fresh.loop_id == keys.loop_id
                and verify(signed, body, fresh.active(now))
            ):
                return fresh
        else:
            verify(signed, body, [_DECOY_KEY])
        raise _unauthorized(
            "no webhook-signature matches this body under the loop's active signing secrets "
            "(unknown loop, wrong or expired secret, or the body changed after signing)",
            "Webhook-Signature",
        )

    async def token_loop(self, token: str | None) -> TokenLoop:
        """The loop of an ``Authorization: Bearer <ingest token>`` (401 when missing/invalid)."""
        if not token:
            raise _unauthorized(
                "missing ingest token: send Authorization: Bearer <the loop's ingest token>",
                "Bearer",
            )
        found = await self.credentials.token_loop(token)
        if found is None or not found.valid(dt.datetime.now(dt.UTC)):
            raise _unauthorized("the ingest token is unknown or expired", "Bearer")
        self.check_accepts_traces(found)
        return found

    # Storage ------------------------------------------------------------------------------

    async def store(
        self,
        *,
        loop_id: int,
        loop_name: str,
        source: str,
        traces: list[tuple[int, StoredTrace]],
        rejected: list[Rejection],
        total: int,
    ) -> list[ItemOutcome]:
        """Store valid traces (durably) and merge their outcomes with the rejected items.

        Raises :class:`StorageUnavailable` when nothing could be stored; then nothing counts
        as accepted.
        """
        INGEST_RECEIVED.labels(loop_name, source).inc(total)
        rows = [TraceRow(loop_id, source, trace) for _, trace in traces]
        try:
            outcomes = await self.writer.write(rows)
        except StorageUnavailable:
            INGEST_REJECTED.labels(loop_name, source, "unavailable").inc(len(rows))
            raise
        results = [
            ItemOutcome(
                index,
                trace.external_id,
                outcome.status,
                outcome.trace_id,
                outcome.reason,
                # A duplicate's warnings would be about a body that was not stored.
                warnings=trace.warnings if outcome.status == WriteStatus.ACCEPTED else (),
            )
            for (index, trace), outcome in zip(traces, outcomes, strict=True)
        ]
        counts = Counter(outcome.status for outcome in outcomes)  # one metric update per kind
        if counts[WriteStatus.ACCEPTED]:
            INGEST_ACCEPTED.labels(loop_name, source).inc(counts[WriteStatus.ACCEPTED])
        if counts[WriteStatus.DUPLICATE]:
            INGEST_DUPLICATE.labels(loop_name, source).inc(counts[WriteStatus.DUPLICATE])
        if counts[WriteStatus.REJECTED]:
            INGEST_REJECTED.labels(loop_name, source, "storage_rejected").inc(
                counts[WriteStatus.REJECTED]
            )
        if rejected:
            INGEST_REJECTED.labels(loop_name, source, "invalid_trace").inc(len(rejected))
            results.extend(
                ItemOutcome(
                    r.index, r.external_id, WriteStatus.REJECTED, reason=r.reason, fields=r.fields
                )
                for r in rejected
            )
            results.sort(key=lambda item: item.index)
        return results

    @staticmethod
    def count_request_rejected(loop: str, source: str, reason: str) -> None:
        """Count a whole request refused before any trace was read (auth, size, syntax)."""
        INGEST_REJECTED.labels(loop, source, reason).inc()

    @staticmethod
    def count_bytes(source: str, size: int) -> None:
        INGEST_BYTES.labels(source).inc(size)

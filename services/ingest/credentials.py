"""Who may post traces: signing secrets by loop name and ingest tokens, cached in memory.

Every webhook request needs its loop's active secrets and every OTLP request the loop of its
token; reading them from Postgres each time would cost a query per request. They are cached
for ``ttl_s`` and re-read early when a signature fails to verify (at most once per
``min_refresh_s``), so a secret created by a rotation in another api replica works at once.
Requests that find the same entry stale at the same time share one read (under load, every
request in flight would otherwise queue its own query on the thread pool when it expires).
Expiry is checked on every request from the cached ``expires_at``, so a rotated-out secret
stops working on time, cache or not. Unknown names and tokens are cached briefly too, so a
flood of bad requests does not become a flood of queries.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from services.db.queries.credentials import loop_for_token, signing_secrets_for
from services.db.session import SessionFactory
from services.ingest.signature import secret_key
from services.ingest.writer import StorageUnavailable

TOKEN_PREFIX = "rit_"
_MAX_ENTRIES = 10_000


def generate_ingest_token() -> str:
    """A new ingest token (``rit_`` + 43 url-safe characters, 256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SigningKey:
    key: bytes
    expires_at: dt.datetime | None


@dataclass(frozen=True)
class LoopKeys:
    """A loop as the webhook needs it: id, name, status and its signing keys."""

    loop_id: int
    name: str
    status: str
    keys: tuple[SigningKey, ...]

    def active(self, now: dt.datetime) -> list[bytes]:
        return [k.key for k in self.keys if k.expires_at is None or k.expires_at > now]


@dataclass(frozen=True)
class TokenLoop:
    """The loop an ingest token belongs to."""

    loop_id: int
    name: str
    status: str
    expires_at: dt.datetime | None

    def valid(self, now: dt.datetime) -> bool:
        return self.expires_at is None or self.expires_at > now


T = TypeVar("T")
A = TypeVar("A")


@dataclass
class _Entry(Generic[T]):
    value: T | None
    fetched_at: float


class CredentialCache:
    """See the module docstring."""

    def __init__(
        self,
        session_factory: SessionFactory,
        *,
        ttl_s: float = 30.0,
        negative_ttl_s: float = 1.0,
        min_refresh_s: float = 1.0,
        retry_after_s: int = 1,
    ) -> None:
        self._session_factory = session_factory
        self._ttl_s = ttl_s
        self._negative_ttl_s = negative_ttl_s
        self._min_refresh_s = min_refresh_s
        self._retry_after_s = retry_after_s
        self._loops: dict[str, _Entry[LoopKeys]] = {}
        self._tokens: dict[str, _Entry[TokenLoop]] = {}
        self._reading: dict[tuple[str, str], asyncio.Future[Any]] = {}

    def _fresh(self, entry: _Entry[Any] | None) -> bool:
        if entry is None:
            return False
        ttl = self._ttl_s if entry.value is not None else self._negative_ttl_s
        return time.monotonic() - entry.fetched_at < ttl

    async def loop_keys(self, name: str) -> LoopKeys | None:
        """The loop named ``name`` and its signing keys; None if there is no such loop."""
        entry = self._loops.get(name)
        if entry is not None and self._fresh(entry):
            return entry.value
        return await self._load_loop(name)

    async def refresh_loop_keys(self, name: str) -> LoopKeys | None:
        """Re-read a loop's keys unless they were read within ``min_refresh_s``."""
        entry = self._loops.get(name)
        if entry is not None and time.monotonic() - entry.fetched_at < self._min_refresh_s:
            return entry.value
        return await self._load_loop(name)

    async def token_loop(self, token: str) -> TokenLoop | None:
        digest = hash_token(token)
        entry = self._tokens.get(digest)
        if entry is not None and self._fresh(entry):
            return entry.value
        return await self._shared_read("token", digest, self._read_token, self._tokens)

    def invalidate(self, name: str) -> None:
        """Forget a loop's cached keys and tokens (after a rotation in this process)."""
        self._loops.pop(name, None)
        self._tokens = {
            k: v for k, v in self._tokens.items() if v.value is None or v.value.name != name
        }

    async def _load_loop(self, name: str) -> LoopKeys | None:
        return await self._shared_read("loop", name, self._read_loop, self._loops)

    async def _shared_read(
        self,
        kind: str,
        key: str,
        read: Callable[[str], T | None],
        table: dict[str, _Entry[T]],
    ) -> T | None:
        """Read ``key`` and remember it; callers that come while a read is in flight wait
        for that one. The read runs in its own task, so a caller that is cancelled (its
        client hung up) does not cancel it for the others."""

        async def read_and_remember() -> T | None:
            try:
                value = await self._query(read, key)
                return self._remember(table, key, value).value
            finally:
                self._reading.pop((kind, key), None)

        pending = self._reading.get((kind, key))
        if pending is None:
            pending = asyncio.ensure_future(read_and_remember())
            # Its failure reaches every caller; retrieve it here too, in case all hung up.
            pending.add_done_callback(lambda task: task.cancelled() or task.exception())
            self._reading[(kind, key)] = pending
        result: T | None = await asyncio.shield(pending)
        return result

    def _remember(self, table: dict[str, _Entry[T]], key: str, value: T | None) -> _Entry[T]:
        if len(table) >= _MAX_ENTRIES:
            table.clear()
        entry = _Entry(value, time.monotonic())
        table[key] = entry
        return entry

    async def _query(self, read: Callable[[A], T | None], argument: A) -> T | None:
        try:
            return await asyncio.to_thread(read, argument)
        except SQLAlchemyError as exc:
            raise StorageUnavailable(
                f"Postgres is unavailable ({type(exc).__name__}); cannot check credentials",
                self._retry_after_s,
            ) from exc

    def _read_loop(self, name: str) -> LoopKeys | None:
        now = dt.datetime.now(dt.UTC)
        with self._session_factory() as session:
            found = signing_secrets_for(session, loop_name=name, now=now)
            if found is None:
                return None
            loop, credentials = found
            keys = tuple(
                SigningKey(secret_key(c.secret), c.expires_at) for c in credentials if c.secret
            )
            return LoopKeys(loop.id, loop.name, loop.status, keys)

    def _read_token(self, digest: str) -> TokenLoop | None:
        now = dt.datetime.now(dt.UTC)
        with self._session_factory() as session:
            found = loop_for_token(session, token_sha256=digest, now=now)
            if found is None:
                return None
            loop, credential = found
            return TokenLoop(loop.id, loop.name, loop.status, credential.expires_at)

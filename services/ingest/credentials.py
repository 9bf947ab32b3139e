"""Who may post traces: signing secrets by loop name and ingest tokens, cached in memory.

Every webhook request needs its loop's active secrets and every OTLP request the loop of its
token; reading them from Postgres each time would cost a query per request. They are cached
for ``ttl_s`` and re-read early when a signature fails to verify (at most once per
``min_refresh_s``), so a secret created by a rotation in another api replica works at once.
Requests that find the same entry stale at the same time share one read (under load, every
request in flight would otherwise queue its own query on the thread pool when it expires).
Expiry is checked on every request from the cached ``expires_at``, so a rotated-out secret
stops working on time, cache or not.

A flood of made-up loop names or tokens must neither cost a query each nor push the real
entries out: the tables are bounded LRUs (10k entries each, the least recently used go
first), unknown tokens live in a table of their own, so they can only evict each other, and
a loop (a token) is looked up only if its name (its digest) is among those that exist: one
list of loop names and active token digests, read at most once per ``negative_ttl_s``
however many made-up ones are asked for.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from services.db.queries.credentials import (
    active_token_digests,
    loop_for_token,
    loop_names,
    signing_secrets_for,
)
from services.db.session import SessionFactory
from services.ingest.signature import secret_key
from services.ingest.writer import StorageUnavailable
from services.secrets import SecretBox

TOKEN_PREFIX = "rit_"
GATEWAY_KEY_PREFIX = "rgk_"
MAX_ENTRIES = 10_000


def generate_ingest_token() -> str:
    """A new ingest token (``rit_`` + 43 url-safe characters, 256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def generate_gateway_key() -> str:
    """A new gateway key (``rgk_`` + 43 url-safe characters, 256 bits): the API key an
    agent gives the capture gateway; it names the loop (services.gateway)."""
    return GATEWAY_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class SigningKey:
    key: bytes
    expires_at: dt.datetime | None


@dataclass(frozen=True)
class IngestLoop:
    """A loop as an ingest door needs it: where traces go, the name in logs and metrics, and
    whether it takes traces at all (an archived one does not)."""

    loop_id: int
    name: str
    status: str


@dataclass(frozen=True)
class LoopKeys(IngestLoop):
    """The webhook's loop, with its signing keys and its environment (whose curation the
    answer's warnings foresee: services.ingest.warnings)."""

    keys: tuple[SigningKey, ...]
    environment: str = ""

    def active(self, now: dt.datetime) -> list[bytes]:
        return [k.key for k in self.keys if k.expires_at is None or k.expires_at > now]


@dataclass(frozen=True)
class TokenLoop(IngestLoop):
    """The loop an ingest token belongs to, until the token expires."""

    expires_at: dt.datetime | None

    def valid(self, now: dt.datetime) -> bool:
        return self.expires_at is None or self.expires_at > now


T = TypeVar("T")
A = TypeVar("A")


@dataclass
class _Entry(Generic[T]):
    value: T | None
    fetched_at: float


class LruTable(Generic[T]):
    """At most ``capacity`` entries; adding one more drops the least recently used."""

    def __init__(self, capacity: int = MAX_ENTRIES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry[T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> _Entry[T] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: _Entry[T]) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def pop(self, key: str) -> None:
        self._entries.pop(key, None)

    def drop_where(self, doomed: Callable[[T | None], bool]) -> None:
        for key in [k for k, entry in self._entries.items() if doomed(entry.value)]:
            del self._entries[key]


class CredentialCache:
    """See the module docstring."""

    def __init__(
        self,
        session_factory: SessionFactory,
        *,
        box: SecretBox | None = None,
        ttl_s: float = 30.0,
        negative_ttl_s: float = 1.0,
        min_refresh_s: float = 1.0,
        capacity: int = MAX_ENTRIES,
    ) -> None:
        self._session_factory = session_factory
        self._box = box
        self._ttl_s = ttl_s
        self._negative_ttl_s = negative_ttl_s
        self._min_refresh_s = min_refresh_s
        self._loops: LruTable[LoopKeys] = LruTable(capacity)
        self._tokens: LruTable[TokenLoop] = LruTable(capacity)
        self._unknown_tokens: LruTable[TokenLoop] = LruTable(capacity)
        self._names: frozenset[str] = frozenset()
        self._token_digests: frozenset[str] = frozenset()
        self._names_read_at = -float("inf")
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
        entry = self._tokens.get(digest) or self._unknown_tokens.get(digest)
        if entry is not None and self._fresh(entry):
            return entry.value
        if not await self._known(digest, lambda: self._token_digests, self._tokens):
            return None
        return await self._shared_read("token", digest, self._read_token, self._remember_token)

    def invalidate(self, name: str) -> None:
        """Forget a loop's cached keys and tokens (after a rotation in this process)."""
        self._loops.pop(name)
        self._tokens.drop_where(lambda value: value is not None and value.name == name)
        self._unknown_tokens = LruTable(self._unknown_tokens.capacity)
        self._names_read_at = -float("inf")

    async def _load_loop(self, name: str) -> LoopKeys | None:
        if not await self._known(name, lambda: self._names, self._loops):
            return None
        return await self._shared_read("loop", name, self._read_loop, self._remember_loop)

    async def _known(
        self, key: str, existing: Callable[[], frozenset[str]], cached: LruTable[Any]
    ) -> bool:
        """Whether ``key`` (a loop name, a token digest) exists, by the list of those that do
        (read at most once per ``negative_ttl_s``, shared by every caller), so made-up ones
        cost no query each."""
        if key in existing() or key in cached:
            return True
        if time.monotonic() - self._names_read_at >= self._negative_ttl_s:
            await self._shared_read("names", "", self._read_names, self._remember_names)
        return key in existing()

    async def _shared_read(
        self,
        kind: str,
        key: str,
        read: Callable[[str], T | None],
        remember: Callable[[str, T | None], None],
    ) -> T | None:
        """Read ``key`` and remember it; callers that come while a read is in flight wait
        for that one. The read runs in its own task, so a caller that is cancelled (its
        client hung up) does not cancel it for the others."""

        async def read_and_remember() -> T | None:
            try:
                value = await self._query(read, key)
                remember(key, value)
                return value
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

    def _remember_loop(self, name: str, value: LoopKeys | None) -> None:
        if value is None:
            self._loops.pop(name)
            self._names = self._names - {name}
        else:
            self._loops.put(name, _Entry(value, time.monotonic()))

    def _remember_token(self, digest: str, value: TokenLoop | None) -> None:
        entry = _Entry(value, time.monotonic())
        if value is None:
            self._tokens.pop(digest)
            self._unknown_tokens.put(digest, entry)
        else:
            self._unknown_tokens.pop(digest)
            self._tokens.put(digest, entry)

    def _remember_names(self, _: str, known: tuple[frozenset[str], frozenset[str]] | None) -> None:
        self._names, self._token_digests = known or (frozenset(), frozenset())
        self._names_read_at = time.monotonic()

    async def _query(self, read: Callable[[A], T | None], argument: A) -> T | None:
        try:
            return await asyncio.to_thread(read, argument)
        except SQLAlchemyError as exc:
            raise StorageUnavailable(
                f"Postgres is unavailable ({type(exc).__name__}); cannot check credentials"
            ) from exc

    def _read_loop(self, name: str) -> LoopKeys | None:
        now = dt.datetime.now(dt.UTC)
        with self._session_factory() as session:
            found = signing_secrets_for(session=session, loop_name=name, now=now)
            if found is None:
                return None
            loop, credentials = found
            keys = tuple(
                SigningKey(secret_key(self._decrypt(c.secret)), c.expires_at)
                for c in credentials
                if c.secret
            )
            return LoopKeys(loop.id, loop.name, loop.status, keys, loop.environment)

    def _decrypt(self, stored: str) -> str:
        if self._box is None:
            raise RuntimeError("this credential cache was built without a SecretBox")
        return self._box.decrypt(stored)

    def _read_names(self, _: str) -> tuple[frozenset[str], frozenset[str]]:
        now = dt.datetime.now(dt.UTC)
        with self._session_factory() as session:
            names = frozenset(loop_names(session=session))
            return names, frozenset(active_token_digests(session=session, now=now))

    def _read_token(self, digest: str) -> TokenLoop | None:
        now = dt.datetime.now(dt.UTC)
        with self._session_factory() as session:
            found = loop_for_token(session=session, token_sha256=digest, now=now)
            if found is None:
                return None
            loop, credential = found
            return TokenLoop(loop.id, loop.name, loop.status, credential.expires_at)

"""A loop by its gateway key, without waiting on Postgres.

Each replica keeps the whole table of active gateway keys (their sha256, expiry, loop and
route): one query every ``RATCHET_GATEWAY_KEY_REFRESH_S``, a few rows per loop. A key not in
the table triggers one early read (shared by every request that asks meanwhile, at most one
per :data:`MIN_MISS_REFRESH_S`), so a key made a moment ago works at once; a revoked or
rotated-out key stops working at the next read, and an expired one at once (its expiry is
checked on every request). When Postgres is down the last table stays in force: agents
keep being answered, which is the gateway's first duty.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from services.db.queries.credentials import active_gateway_keys
from services.db.session import SessionFactory
from services.gateway.routing import NoRoute, Route, route_for
from services.ingest.credentials import hash_token
from services.settings import Settings

log = logging.getLogger(__name__)

MIN_MISS_REFRESH_S = 1.0


@dataclass(frozen=True)
class GatewayLoop:
    """What a request needs of its loop: its id and name, whether it takes traffic, and
    where its calls go."""

    loop_id: int
    name: str
    status: str
    route: Route | NoRoute
    expires_at: dt.datetime | None

    def valid(self, now: dt.datetime) -> bool:
        return self.expires_at is None or self.expires_at > now


Reader = Callable[[], dict[str, GatewayLoop]]


class KeyTable:
    """See the module docstring."""

    def __init__(self, read: Reader, *, refresh_s: float) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._table: dict[str, GatewayLoop] = {}
        self._read_at = -float("inf")
        self._loaded = False
        self._pending: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def loaded(self) -> bool:
        """Whether the table was read at least once (the gateway is ready)."""
        return self._loaded

    def start(self) -> None:
        self._task = asyncio.create_task(self._refresh_loop(), name="gateway-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def lookup(self, key: str) -> GatewayLoop | None:
        """The loop of a valid key, None for an unknown, revoked or expired one. Raises
        :class:`KeysUnavailable` when the key is not known and Postgres cannot be asked."""
        digest = hash_token(key)
        found = self._table.get(digest)
        if found is None and time.monotonic() - self._read_at >= MIN_MISS_REFRESH_S:
            await self.refresh()
            found = self._table.get(digest)
        if found is None or not found.valid(dt.datetime.now(dt.UTC)):
            return None
        return found

    async def refresh(self) -> None:
        """Read the table now (one read shared by every caller that comes meanwhile)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._load())
            self._pending.add_done_callback(self._done)
        await asyncio.shield(self._pending)

    def _done(self, future: asyncio.Future[None]) -> None:
        self._pending = None
        if not future.cancelled():
            future.exception()

    async def _load(self) -> None:
        try:
            table = await asyncio.to_thread(self._read)
        except SQLAlchemyError as exc:
            self._read_at = time.monotonic()
            if not self._loaded:
                raise KeysUnavailable(
                    f"Postgres is unavailable ({type(exc).__name__}); cannot check the key"
                ) from exc
            log.warning("gateway: cannot re-read the keys (%s); keeping the last table", exc)
            return
        self._table, self._read_at, self._loaded = table, time.monotonic(), True

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except KeysUnavailable as exc:
                log.warning("gateway: %s", exc)
            except Exception:
                log.exception("gateway: reading the keys failed")
            await asyncio.sleep(self._refresh_s)


class KeysUnavailable(Exception):
    """The key is not known here and Postgres cannot be asked: a 503, try again."""


def table_reader(session_factory: SessionFactory, settings: Settings) -> Reader:
    """The reader of the key table from Postgres, with each loop's route."""

    def read() -> dict[str, GatewayLoop]:
        now = dt.datetime.now(dt.UTC)
        with session_factory() as session:
            rows = active_gateway_keys(session=session, now=now)
            table = {}
            for digest, expires_at, loop in rows:
                route = route_for(
                    loop.serving_target or {},
                    has_champion=loop.champion_checkpoint_id is not None,
                    settings=settings,
                )
                table[digest] = GatewayLoop(loop.id, loop.name, loop.status, route, expires_at)
            return table

    return read

"""What the api process holds for its lifetime: settings, the DB engine, a Temporal client."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from temporalio.client import Client

from services.db.session import SessionFactory
from services.secrets import SecretBox
from services.settings import Settings
from services.temporal import connect_temporal

if TYPE_CHECKING:
    from services.api.wake import LoopWaker
    from services.ingest.service import IngestService
    from services.ingest.span_store import EpisodeAssembler


@dataclass
class TemporalConnection:
    """Connects on first use, so the api starts (and serves health) while Temporal is down."""

    settings: Settings
    client: Client | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self) -> Client:
        if self.client is None:
            async with self._lock:
                if self.client is None:
                    self.client = await asyncio.wait_for(connect_temporal(self.settings), 5)
        return self.client


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    session_factory: SessionFactory
    temporal: TemporalConnection
    # Owned by the route modules that start and stop them (services.api.routes.traces and
    # .otlp); None while they are not running, which the routes answer with a 503.
    ingest: IngestService | None = None
    waker: LoopWaker | None = None
    otlp_assembler: EpisodeAssembler | None = None
    otlp_sweeper: asyncio.Task[None] | None = None
    _secret_box: SecretBox | None = None

    @property
    def secret_box(self) -> SecretBox:
        """Encrypts signing secrets for storage (built on first use: it may create the
        embedded stack's key file)."""
        if self._secret_box is None:
            self._secret_box = SecretBox.from_settings(self.settings)
        return self._secret_box

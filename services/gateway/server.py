"""The gateway process (``ratchet gateway``): its parts wired and run under uvicorn.

One process per replica, single event loop: the spool is the replica's own (its directory
must not be shared), the writer drains it, the key table and the assembler read Postgres on
their own schedule. Nothing a request waits for touches Postgres once the key table is read.
Stopping (SIGTERM) stops taking requests, drains the spool for up to ten seconds, and leaves
the rest in the spool for the next start.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from services.db.session import engine_from_settings, make_session_factory
from services.gateway.app import GatewayApp, GatewayParts
from services.gateway.assembler import Assembler
from services.gateway.capture import CapturedCall
from services.gateway.forward import build_client
from services.gateway.keys import KeyTable, table_reader
from services.gateway.spool import Spool
from services.gateway.writer import SpoolWriter
from services.ingest.service import conninfo_from_engine
from services.metrics import GATEWAY_CAPTURED, GATEWAY_DROPPED
from services.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Capture:
    """The app's capture sink: append to the spool, or count the call as dropped. The writer
    is not woken per call: it drains every ``IDLE_WAIT_S`` (services.gateway.writer), so under
    load one insert and one cursor write carry many calls instead of one each."""

    spool: Spool
    appended: int = 0
    dropped: int = field(default=0)

    def __call__(self, call: CapturedCall) -> None:
        try:
            written = self.spool.append(call.encode())
        except OSError:
            log.exception("gateway: cannot write to the spool; call %s not captured", call.call_id)
            GATEWAY_DROPPED.labels(call.loop, "spool_error").inc()
            self.dropped += 1
            return
        if not written:
            GATEWAY_DROPPED.labels(call.loop, "spool_full").inc()
            self.dropped += 1
            return
        self.appended += 1
        GATEWAY_CAPTURED.labels(call.loop).inc()


def build_gateway(settings: Settings, *, serve_metrics: bool = True) -> GatewayApp:
    """The gateway's app over settings; its parts start and stop on the ASGI lifespan."""
    engine = engine_from_settings(settings, application="ratchet-gateway")
    session_factory = make_session_factory(engine)
    spool = Spool(
        settings.effective_gateway_spool_dir,
        max_bytes=settings.gateway_spool_max_bytes,
        fsync_s=settings.gateway_spool_fsync_ms / 1000.0,
    )
    writer = SpoolWriter(spool, conninfo_from_engine(engine))
    capture = Capture(spool)
    keys = KeyTable(
        table_reader(session_factory, settings), refresh_s=settings.gateway_key_refresh_s
    )
    assembler = Assembler(session_factory, idle_s=settings.gateway_session_idle_s)
    client = build_client(settings.gateway_upstream_timeout_s)
    background: list[asyncio.Task[None]] = []

    async def startup() -> None:
        spool.open()
        if spool.torn_records:
            log.warning("gateway: %d torn spool records skipped (a power cut)", spool.torn_records)
        writer.start()
        keys.start()
        background.append(asyncio.create_task(assembler.run(), name="gateway-assembler"))
        log.info("gateway: spool %s (%d bytes waiting)", spool.directory, spool.pending_bytes)

    async def shutdown() -> None:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await keys.stop()
        await writer.stop()
        spool.close()
        await client.aclose()
        engine.dispose()

    parts = GatewayParts(
        keys=keys,
        client=client,
        record=capture,
        max_body_bytes=settings.gateway_max_body_bytes,
        serve_metrics=serve_metrics,
    )
    return GatewayApp(parts, startup=startup, shutdown=shutdown)

"""Waiting spans in a real Postgres, shared by several api replicas (two assemblers, two
writers, one database): each trace is assembled once, whoever sweeps or exports it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sqlalchemy import Engine, func, select

from services.db.models import Loop, OtlpPendingTrace, OtlpSpan, Trace
from services.db.session import SessionFactory
from services.ingest.otlp import DecodedExport, Limits, read_spans
from services.ingest.service import IngestService, conninfo_from_engine
from services.ingest.span_store import EpisodeAssembler
from services.settings import Settings
from tests.services.api.test_otlp import spans_of_one_episode

LIMITS = Limits(max_traces=500, max_spans=10_000, max_attribute_bytes=1 << 20)


def decoded(spans: list[Any]) -> DecodedExport:
    return read_spans(encode_spans(spans), LIMITS)


@pytest.fixture
def loop_id(session_factory: SessionFactory) -> int:
    with session_factory.begin() as session:
        loop = Loop(name="otlp-replicas", environment="toolcalc")
        session.add(loop)
        session.flush()
        return loop.id


Replica = tuple[EpisodeAssembler, IngestService]


@pytest.fixture
async def replicas(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> AsyncIterator[list[Replica]]:
    settings = Settings(database_url=database_url, otlp_episode_quiet_s=0.2)
    made: list[Replica] = []
    for _ in range(2):
        service = IngestService(
            settings=settings,
            session_factory=session_factory,
            conninfo=conninfo_from_engine(engine),
        )
        await service.start()
        made.append((EpisodeAssembler(settings=settings, session_factory=session_factory), service))
    yield made
    for _, service in made:
        await service.stop()


def count(session_factory: SessionFactory, what: Any, *where: Any) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(what).where(*where)) or 0)


async def test_two_sweepers_share_quiet_traces_and_assemble_each_once(
    replicas: list[Replica], loop_id: int, session_factory: SessionFactory
) -> None:
    (first, first_service), (second, second_service) = replicas
    for _ in range(12):
        children = [s for s in spans_of_one_episode() if s.parent is not None]
        report = await first.ingest(
            first_service, loop_id=loop_id, loop_name="otlp-replicas", decoded=decoded(children)
        )
        assert report.rejected == 0
    assert count(session_factory, Trace) == 0
    assert count(session_factory, OtlpPendingTrace) == 12
    await asyncio.sleep(0.3)  # the quiet period

    claimed = await asyncio.gather(
        first.sweep_once(first_service), second.sweep_once(second_service)
    )

    assert sum(claimed) == 12  # no trace claimed twice
    assert count(session_factory, Trace) == 12
    assert count(session_factory, OtlpPendingTrace) == 0
    assert count(session_factory, OtlpSpan, OtlpSpan.assembled_at.is_(None)) == 0
    # Nothing is left to claim.
    assert await first.sweep_once(first_service) == 0


async def test_concurrent_exports_of_one_trace_to_two_replicas_make_one_trace(
    replicas: list[Replica], loop_id: int, session_factory: SessionFactory
) -> None:
    (first, first_service), (second, second_service) = replicas
    for _ in range(5):
        spans = spans_of_one_episode()  # the agent span last
        reports = await asyncio.gather(
            first.ingest(
                first_service,
                loop_id=loop_id,
                loop_name="otlp-replicas",
                decoded=decoded(spans[:2]),
            ),
            second.ingest(
                second_service,
                loop_id=loop_id,
                loop_name="otlp-replicas",
                decoded=decoded(spans[2:]),
            ),
        )
        # Whichever order Postgres put them in: stored once, and any span the trace could not
        # take (the children arriving after their agent span) is reported, not kept waiting.
        late = sum(report.rejected for report in reports)
        assert late in (0, 2)
    assert count(session_factory, Trace) == 5
    assert count(session_factory, OtlpSpan, OtlpSpan.assembled_at.is_(None)) == 0


async def test_a_trace_that_never_goes_quiet_is_assembled_after_the_max_wait(
    database_url: str, engine: Engine, session_factory: SessionFactory, loop_id: int
) -> None:
    settings = Settings(
        database_url=database_url, otlp_episode_quiet_s=3600, otlp_episode_max_wait_s=0.2
    )
    service = IngestService(
        settings=settings, session_factory=session_factory, conninfo=conninfo_from_engine(engine)
    )
    await service.start()
    try:
        assembler = EpisodeAssembler(settings=settings, session_factory=session_factory)
        spans = [s for s in spans_of_one_episode() if s.parent is not None]
        await assembler.ingest(
            service, loop_id=loop_id, loop_name="otlp-replicas", decoded=decoded(spans[:1])
        )
        await asyncio.sleep(0.3)
        # Still receiving: not quiet, but waiting longer than the max wait.
        await assembler.ingest(
            service, loop_id=loop_id, loop_name="otlp-replicas", decoded=decoded(spans[1:])
        )
        assert await assembler.sweep_once(service) == 1
        assert count(session_factory, Trace) == 1
    finally:
        await service.stop()


async def test_a_sweep_the_writer_refuses_keeps_its_claims_and_loses_nothing(
    replicas: list[Replica], loop_id: int, session_factory: SessionFactory
) -> None:
    (assembler, service), (_, other_service) = replicas
    children = [s for s in spans_of_one_episode() if s.parent is not None]
    await assembler.ingest(
        service, loop_id=loop_id, loop_name="otlp-replicas", decoded=decoded(children)
    )
    await asyncio.sleep(0.3)
    await service.stop()  # the writer refuses from now on

    assert await assembler.sweep_once(service) == 0  # nothing handled: do not sweep again now
    assert count(session_factory, Trace) == 0
    assert count(session_factory, OtlpSpan, OtlpSpan.assembled_at.is_(None)) == len(children)
    # Still leased to this replica: another one does not take it before the lease ends.
    assert await assembler.sweep_once(other_service) == 0
    assert (
        count(session_factory, OtlpPendingTrace, OtlpPendingTrace.claimed_until.is_not(None)) == 1
    )

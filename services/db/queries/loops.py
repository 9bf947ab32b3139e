"""Loop rows: create (name unique), look up, list. The caller owns the transaction."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.db.models import Loop, Trace


class LoopNameTaken(Exception):
    """A loop with this name exists already."""


@dataclass(frozen=True)
class LoopFields:
    """Everything a new loop is created with (already validated by the caller)."""

    name: str
    environment: str
    executor: str = "local"
    training_profile: dict[str, Any] | None = None
    serving_target: dict[str, Any] | None = None
    gate_policy: dict[str, Any] | None = None
    trigger_policy: dict[str, Any] | None = None
    curation_policy: dict[str, Any] | None = None
    budget_usd: Decimal | None = None


def create_loop(session: Session, *, fields: LoopFields) -> Loop:
    """Insert a loop; :class:`LoopNameTaken` if the name is used (checked by the unique key,
    so two concurrent creations cannot both succeed)."""
    loop = Loop(
        name=fields.name,
        environment=fields.environment,
        executor=fields.executor,
        training_profile=fields.training_profile or {},
        serving_target=fields.serving_target or {},
        gate_policy=fields.gate_policy or {},
        trigger_policy=fields.trigger_policy or {},
        curation_policy=fields.curation_policy or {},
        budget_usd=fields.budget_usd,
    )
    try:
        with session.begin_nested():
            session.add(loop)
            session.flush()
    except IntegrityError as exc:
        if "uq_loops_name" in str(exc.orig):
            raise LoopNameTaken(fields.name) from None
        raise
    session.refresh(loop)
    return loop


def get_loop(session: Session, *, name: str) -> Loop | None:
    return session.scalar(select(Loop).where(Loop.name == name))


def list_loops(session: Session) -> Sequence[Loop]:
    return session.scalars(select(Loop).order_by(Loop.name)).all()


@dataclass(frozen=True)
class TraceStats:
    count: int
    last_received_at: dt.datetime | None


def trace_stats(session: Session, *, loop_id: int) -> TraceStats:
    """How many traces a loop has and when the last one arrived."""
    row = session.execute(
        select(func.count(), func.max(Trace.received_at)).where(Trace.loop_id == loop_id)
    ).one()
    return TraceStats(count=int(row[0]), last_received_at=row[1])

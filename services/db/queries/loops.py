"""Loop rows: create (name unique), look up, list, change their configuration with a history.

The caller owns the transaction.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.db.models import Loop, LoopConfigVersion, Trace
from services.db.queries.errors import existing
from services.loop.config import CONFIG_KEYS, Change, diff
from services.loop.states import LoopLifecycle


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
    changed_by: str = "admin-api"


def create_loop(*, session: Session, fields: LoopFields) -> Loop:
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
    record_config_version(
        session=session, loop=loop, changes=[], changed_by=fields.changed_by, reason="created"
    )
    return loop


def require_loop(*, session: Session, name: str, for_update: bool = False) -> Loop:
    """The loop called ``name``; :class:`NotFound` if there is none.

    ``for_update`` locks its row until the transaction ends, so concurrent changes (of the
    configuration, the champion, the status) apply one after the other, each to what the
    previous one left.
    """
    statement = select(Loop).where(Loop.name == name)
    if for_update:
        statement = statement.with_for_update()
    return existing(session.scalars(statement).one_or_none(), f"loop {name!r}")


def list_loops(*, session: Session) -> Sequence[Loop]:
    return session.scalars(select(Loop).order_by(Loop.name)).all()


def serving_targets_of_other_loops(
    *, session: Session, except_name: str
) -> list[tuple[str, dict[str, Any]]]:
    """``(name, serving target)`` of every loop but ``except_name`` that is not archived."""
    rows = session.execute(
        select(Loop.name, Loop.serving_target)
        .where(Loop.name != except_name, Loop.status != LoopLifecycle.ARCHIVED)
        .order_by(Loop.name)
    ).all()
    return [(name, dict(target or {})) for name, target in rows]


@dataclass(frozen=True)
class TraceStats:
    count: int
    last_received_at: dt.datetime | None


def trace_stats(*, session: Session, loop_id: int) -> TraceStats:
    """How many traces a loop has and when the last one arrived."""
    row = session.execute(
        select(func.count(), func.max(Trace.received_at)).where(Trace.loop_id == loop_id)
    ).one()
    return TraceStats(count=int(row[0]), last_received_at=row[1])


def config_document(loop: Loop) -> dict[str, Any]:
    """The loop's configuration as one JSON document (what a version stores)."""
    return {
        "environment": loop.environment,
        "executor": loop.executor,
        "budget_usd": float(loop.budget_usd) if loop.budget_usd is not None else None,
        "training_profile": dict(loop.training_profile or {}),
        "gate_policy": dict(loop.gate_policy or {}),
        "trigger_policy": dict(loop.trigger_policy or {}),
        "curation_policy": dict(loop.curation_policy or {}),
        "serving_target": dict(loop.serving_target or {}),
    }


def record_config_version(
    *,
    session: Session,
    loop: Loop,
    changes: list[Change],
    changed_by: str,
    reason: str | None = None,
) -> LoopConfigVersion:
    """Append the loop's current configuration as its next version.

    The loop row is locked first, so two concurrent changes get versions n and n+1, never
    the same number.
    """
    session.execute(select(Loop.id).where(Loop.id == loop.id).with_for_update())
    latest = session.scalar(
        select(func.max(LoopConfigVersion.version)).where(LoopConfigVersion.loop_id == loop.id)
    )
    row = LoopConfigVersion(
        loop_id=loop.id,
        version=int(latest or 0) + 1,
        config=config_document(loop),
        changes=[change.to_dict() for change in changes],
        changed_by=changed_by[:200],
        reason=reason,
    )
    session.add(row)
    session.flush()
    return row


@dataclass(frozen=True)
class ConfigUpdate:
    """What a configuration change did: the changes, and the new version (None: no change)."""

    loop: Loop
    changes: list[Change]
    version: LoopConfigVersion | None


def update_loop_config(
    *,
    session: Session,
    loop: Loop,
    config: dict[str, Any],
    changed_by: str,
    reason: str | None = None,
) -> ConfigUpdate:
    """Set the loop's configuration to ``config`` (a full, validated document) and record it.

    A document equal to the current one changes nothing and records no version, so applying
    the same file twice is a no-op.
    """
    before = config_document(loop)
    after = {key: config.get(key, before.get(key)) for key in CONFIG_KEYS}
    changes = diff(before, after)
    if not changes:
        return ConfigUpdate(loop=loop, changes=[], version=None)
    if not config_versions(session=session, loop_id=loop.id, limit=1):
        # A loop written by other means (SQL, an old release): keep where it started from.
        record_config_version(
            session=session,
            loop=loop,
            changes=[],
            changed_by="unknown",
            reason="before the first change",
        )
    loop.executor = str(after["executor"])
    budget = after["budget_usd"]
    loop.budget_usd = Decimal(str(budget)) if budget is not None else None
    loop.training_profile = dict(after["training_profile"] or {})
    loop.gate_policy = dict(after["gate_policy"] or {})
    loop.trigger_policy = dict(after["trigger_policy"] or {})
    loop.curation_policy = dict(after["curation_policy"] or {})
    loop.serving_target = dict(after["serving_target"] or {})
    session.flush()
    version = record_config_version(
        session=session, loop=loop, changes=changes, changed_by=changed_by, reason=reason
    )
    return ConfigUpdate(loop=loop, changes=changes, version=version)


def config_at(*, session: Session, loop_id: int, at: dt.datetime) -> dict[str, Any] | None:
    """The loop's configuration as it was at ``at`` (None before its first version)."""
    config = session.scalar(
        select(LoopConfigVersion.config)
        .where(LoopConfigVersion.loop_id == loop_id, LoopConfigVersion.created_at <= at)
        .order_by(LoopConfigVersion.version.desc())
        .limit(1)
    )
    return dict(config) if config is not None else None


def config_versions(
    *, session: Session, loop_id: int, limit: int = 50
) -> Sequence[LoopConfigVersion]:
    """The loop's configuration versions, newest first."""
    return session.scalars(
        select(LoopConfigVersion)
        .where(LoopConfigVersion.loop_id == loop_id)
        .order_by(LoopConfigVersion.version.desc())
        .limit(limit)
    ).all()

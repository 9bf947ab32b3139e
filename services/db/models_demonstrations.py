"""Kept episodes: the verified successes and failures of curated tasks, with their exact
tokens (services.curation.demonstrations). Kept apart from services.db.models, which
re-exports it, so the domain model's module stays one screenful of tables."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base
from services.db.columns import now_column


class Demonstration(Base):
    """One verified episode of a curated task, kept with its exact tokens: a success is a
    demonstration of the task, a failure beside a success of the same task makes a
    preference pair (services.curation.demonstrations; docs/design.md, "Demonstrations").

    Keyed by the task's content hash (``task_hash``, the job task id every job file names)
    and the run that sampled it (``run_id``, ``sample``: its line in that run's
    ``episodes.jsonl``), so recording a run twice stores nothing twice. ``sequences`` is
    the episode as training reads it: ``[[ids, mask], ...]`` in the tokenizer of
    ``family``/``checkpoint_id``. At most ``Settings.demonstrations_per_task`` successes and
    as many failures are kept per task (the newest)."""

    __tablename__ = "demonstrations"
    __table_args__ = (
        UniqueConstraint("run_id", "sample", name="uq_demonstrations_run_sample"),
        CheckConstraint("source IN ('train', 'eval', 'probe')", name="source"),
        Index("ix_demonstrations_task_passed", "task_id", "passed", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    task_hash: Mapped[str] = mapped_column(String(64))
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    sample: Mapped[int] = mapped_column(Integer)
    source: Mapped[str] = mapped_column(String(16))
    checkpoint_id: Mapped[str | None] = mapped_column(String(128))
    family: Mapped[str] = mapped_column(String(32))
    passed: Mapped[bool] = mapped_column(Boolean)
    reward: Mapped[float] = mapped_column(Float)
    text: Mapped[str] = mapped_column(Text)
    tokens: Mapped[int] = mapped_column(Integer)
    sequences: Mapped[list[Any]] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = now_column()

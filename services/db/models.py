"""The data model of DESIGN §2: tables for loops, traces, tasks, datasets, cycles, runs,
checkpoints, evaluations and promotions.

Invariants live in the schema wherever Postgres can hold them (unique keys, partial unique
indexes, check constraints), so a bug in a caller cannot break them. Lineage is a chain of
foreign keys: trace → task_sources → task → dataset_tasks → dataset → run → checkpoint →
promotion, and ``loops.champion_checkpoint_id`` says which checkpoint serves now.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from services.db.base import Base
from services.db.columns import JSON, now_column
from services.db.models_partitioned import OtlpSpanPayload, PartitionRetirement, TraceBody


class Loop(Base):
    """One served model being improved, forever."""

    __tablename__ = "loops"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'paused', 'archived')", name="status"),
        CheckConstraint("name ~ '^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$'", name="name_format"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(40), unique=True)
    environment: Mapped[str] = mapped_column(String(64))
    executor: Mapped[str] = mapped_column(String(32), server_default="local")
    training_profile: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    serving_target: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    gate_policy: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    trigger_policy: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    curation_policy: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    budget_usd: Mapped[Decimal | None] = mapped_column(Numeric(14, 4))
    status: Mapped[str] = mapped_column(String(16), server_default="active")
    status_reason: Mapped[str | None] = mapped_column(Text)
    champion_checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL")
    )
    created_at: Mapped[dt.datetime] = now_column()
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )

    champion: Mapped[Checkpoint | None] = relationship(
        foreign_keys=[champion_checkpoint_id], post_update=True
    )


class Credential(Base):
    """A webhook signing secret, an ingest token or a gateway key of a loop.

    Two may be active at once so a secret can be rotated with a grace period. Signing
    secrets must be stored whole (HMAC needs them); ingest tokens and gateway keys are stored
    as sha256 digests only.
    """

    __tablename__ = "credentials"
    __table_args__ = (
        CheckConstraint("kind IN ('signing_secret', 'ingest_token', 'gateway_key')", name="kind"),
        Index("ix_credentials_loop_kind", "loop_id", "kind"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    secret: Mapped[str | None] = mapped_column(Text)
    token_sha256: Mapped[str | None] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = now_column()
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Trace(Base):
    """One production episode as reported. (loop, external id) is unique: a re-post is a no-op."""

    __tablename__ = "traces"
    __table_args__ = (
        UniqueConstraint("loop_id", "external_id"),
        # What a body's foreign key references: its trace and its partition key together.
        UniqueConstraint("id", "received_at"),
        Index("ix_traces_loop_received", "loop_id", "received_at"),
        Index(
            "ix_traces_uncurated",
            "loop_id",
            "id",
            postgresql_where=text("curated_at IS NULL"),
        ),
        Index("ix_traces_loop_model_received", "loop_id", "model_version", "received_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    external_id: Mapped[str] = mapped_column(String(256))
    source: Mapped[str] = mapped_column(String(16), server_default="webhook")
    model_version: Mapped[str | None] = mapped_column(String(256))
    success: Mapped[bool | None] = mapped_column(Boolean)
    score: Mapped[float | None] = mapped_column(Float)
    error_kind: Mapped[str | None] = mapped_column(String(128))
    size_bytes: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    received_at: Mapped[dt.datetime] = now_column()
    curated_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    curation_outcome: Mapped[str | None] = mapped_column(String(32))
    curation_detail: Mapped[str | None] = mapped_column(Text)
    # Attempts that failed to curate the trace alone; at the bound it is set aside (issue 43).
    curation_attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    stored_body: Mapped[TraceBody | None] = relationship(
        lazy="selectin", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def body(self) -> dict[str, Any]:
        """The raw body (in ``trace_bodies``); ``{}`` once retention purged it."""
        return self.stored_body.body if self.stored_body is not None else {}

    @body.setter
    def body(self, value: dict[str, Any]) -> None:
        self.stored_body = TraceBody(body=value)


class Task(Base):
    """A curated, verifiable RL task. Its dedup key is unique per loop.

    Three identities meet here: ``id`` is the row id (what ``task_id`` columns reference);
    ``content_hash`` holds curation's dedup key (:func:`services.curation.similarity.dedup_key`;
    the column keeps its first name); ``spec["task_id"]`` is the task id a job sees
    (:func:`services.environments.base.compute_task_id`).
    """

    __tablename__ = "tasks"
    __table_args__ = (
        UniqueConstraint("loop_id", "content_hash"),
        CheckConstraint("split IN ('train', 'eval', 'heldout', 'regression')", name="split"),
        Index("ix_tasks_loop_split", "loop_id", "split"),
        Index("ix_tasks_loop_cluster", "loop_id", "cluster_id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    content_hash: Mapped[str] = mapped_column(String(64))
    environment: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    origin: Mapped[str] = mapped_column(String(16), server_default="failure")
    cluster_id: Mapped[str] = mapped_column(String(64))
    split: Mapped[str] = mapped_column(String(16))
    weight: Mapped[int] = mapped_column(Integer, server_default="1")
    pinned: Mapped[bool] = mapped_column(Boolean, server_default="false")
    failure_signature: Mapped[str | None] = mapped_column(String(256))
    redactions: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    probe_pass_rate: Mapped[float | None] = mapped_column(Float)
    minhash: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[dt.datetime] = now_column()
    # Set aside: kept, shown with its reason, never in a snapshot's train split (e.g.
    # ``unanswerable_calls``: every episode needed a tool result nobody could give).
    set_aside_reason: Mapped[str | None] = mapped_column(String(32))
    set_aside_detail: Mapped[str | None] = mapped_column(Text)
    set_aside_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class TaskSource(Base):
    """Which traces a task came from (a deduplicated task keeps all of them)."""

    __tablename__ = "task_sources"

    task_id: Mapped[int] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    trace_id: Mapped[int] = mapped_column(
        ForeignKey("traces.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    relation: Mapped[str] = mapped_column(String(16), server_default="origin")


class LshBucket(Base):
    """Persisted MinHash-LSH bands, so a new trace is matched against every earlier task.

    ``loop_id`` has no foreign key of its own: the row goes with its task (which goes with
    its loop), and checking a second key for 16 rows per new task cost curation ~10%
    (migration 0006).
    """

    __tablename__ = "lsh_buckets"

    loop_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    band: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[bytes] = mapped_column(LargeBinary, primary_key=True)
    task_id: Mapped[int] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )


class Dataset(Base):
    """An immutable snapshot of tasks for one cycle. Never mutated after creation."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("loop_id", "content_hash"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    content_hash: Mapped[str] = mapped_column(String(64))
    train_count: Mapped[int] = mapped_column(Integer)
    eval_count: Mapped[int] = mapped_column(Integer)
    regression_count: Mapped[int] = mapped_column(Integer, server_default="0")
    train_uri: Mapped[str] = mapped_column(Text)
    eval_uri: Mapped[str] = mapped_column(Text)
    regression_uri: Mapped[str | None] = mapped_column(Text)
    # The frozen held-out set as of this snapshot: evaluated for points gained, never trained.
    heldout_count: Mapped[int] = mapped_column(Integer, server_default="0")
    heldout_uri: Mapped[str | None] = mapped_column(Text)
    # Successes on the trained side (services.curation.splits): what rft replays; never
    # judged. The regression suite above holds the rest.
    replay_count: Mapped[int] = mapped_column(Integer, server_default="0")
    replay_uri: Mapped[str | None] = mapped_column(Text)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    created_at: Mapped[dt.datetime] = now_column()


class DatasetTask(Base):
    """Membership of a task in a dataset, with the split it has there."""

    __tablename__ = "dataset_tasks"
    __table_args__ = (
        CheckConstraint(
            "split IN ('train', 'replay', 'eval', 'heldout', 'regression')", name="split"
        ),
    )

    dataset_id: Mapped[int] = mapped_column(
        ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[int] = mapped_column(
        ForeignKey("tasks.id", ondelete="RESTRICT"), primary_key=True, index=True
    )
    split: Mapped[str] = mapped_column(String(16))


class Cycle(Base):
    """One turn of a loop. At most one open cycle per loop."""

    __tablename__ = "cycles"
    __table_args__ = (
        UniqueConstraint("loop_id", "number"),
        Index(
            "uq_cycles_one_open_per_loop",
            "loop_id",
            unique=True,
            postgresql_where=text("ended_at IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    trigger: Mapped[str] = mapped_column(String(32))
    trigger_detail: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    stage: Mapped[str] = mapped_column(String(32), server_default="curate")
    outcome: Mapped[str | None] = mapped_column(String(32))
    outcome_detail: Mapped[str | None] = mapped_column(Text)
    workflow_id: Mapped[str | None] = mapped_column(String(256))
    dataset_id: Mapped[int | None] = mapped_column(ForeignKey("datasets.id"))
    champion_checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True)
    )
    candidate_checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True)
    )
    stage_timings: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    compute_seconds: Mapped[float] = mapped_column(Float, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(14, 6), server_default="0")
    # Held-out points gained (the headline; the ledger's $ per point), the gate's points on
    # new failures and the live delta after the canary; intervals and counts in points_detail.
    points_gained: Mapped[float | None] = mapped_column(Float)
    gate_points: Mapped[float | None] = mapped_column(Float)
    live_points: Mapped[float | None] = mapped_column(Float)
    points_detail: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    # What the cycle was expected to cost before it trained (services.loop.estimate), and
    # where its money went: {phase: {seconds, compute_s, cost_usd}} over its runs.
    estimate_usd: Mapped[Decimal | None] = mapped_column(Numeric(14, 6))
    estimate: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    cost_by_phase: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    started_at: Mapped[dt.datetime] = now_column()
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Run(Base):
    """One job on an executor. The id is derived from the cycle, so a retry never makes two."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint("kind IN ('train', 'eval', 'probe', 'calibrate')", name="kind"),
        CheckConstraint(
            "status IN ('pending', 'running', 'succeeded', 'failed', 'cancelled', 'lost')",
            name="status",
        ),
        Index("ix_runs_loop_submitted", "loop_id", "submitted_at"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    cycle_id: Mapped[int | None] = mapped_column(ForeignKey("cycles.id", ondelete="SET NULL"))
    dataset_id: Mapped[int | None] = mapped_column(ForeignKey("datasets.id"))
    base_checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True)
    )
    kind: Mapped[str] = mapped_column(String(16))
    executor: Mapped[str] = mapped_column(String(32))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    handle: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), server_default="pending")
    error: Mapped[str | None] = mapped_column(Text)
    accelerators: Mapped[int] = mapped_column(Integer, server_default="0")
    compute_seconds: Mapped[float] = mapped_column(Float, server_default="0")
    cpu_seconds: Mapped[float] = mapped_column(Float, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(14, 6), server_default="0")
    output_uri: Mapped[str | None] = mapped_column(Text)
    logs_uri: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    submitted_at: Mapped[dt.datetime] = now_column()
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Checkpoint(Base):
    """A model artifact, content-addressed: the id is the sha256 of its manifest."""

    __tablename__ = "checkpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"), index=True)
    uri: Mapped[str] = mapped_column(Text)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", use_alter=True))
    format: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = now_column()


class Evaluation(Base):
    """A checkpoint run on a task set; per-task rows are kept so comparisons are paired."""

    __tablename__ = "evaluations"
    __table_args__ = (
        UniqueConstraint("cycle_id", "checkpoint_id", "task_set"),
        CheckConstraint("task_set IN ('eval', 'regression', 'heldout', 'probe')", name="task_set"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    cycle_id: Mapped[int | None] = mapped_column(ForeignKey("cycles.id", ondelete="CASCADE"))
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id"))
    dataset_id: Mapped[int | None] = mapped_column(ForeignKey("datasets.id"))
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id"))
    task_set: Mapped[str] = mapped_column(String(16))
    n: Mapped[int] = mapped_column(Integer)
    passed: Mapped[int] = mapped_column(Integer)
    pass_rate: Mapped[float] = mapped_column(Float)
    ci_low: Mapped[float] = mapped_column(Float)
    ci_high: Mapped[float] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = now_column()


class EvaluationResult(Base):
    """One task's outcome in one evaluation."""

    __tablename__ = "evaluation_results"

    evaluation_id: Mapped[int] = mapped_column(
        ForeignKey("evaluations.id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), primary_key=True)
    passed: Mapped[bool] = mapped_column(Boolean)
    reward: Mapped[float] = mapped_column(Float)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")


class Promotion(Base):
    """The gate's decision for a cycle and what followed (deploy, canary, rollback)."""

    __tablename__ = "promotions"
    __table_args__ = (
        CheckConstraint("decision IN ('promote', 'reject', 'rollback')", name="decision"),
        CheckConstraint(
            "status IN ('decided', 'deploying', 'canary', 'held', 'rolled_back', 'rejected',"
            " 'failed')",
            name="status",
        ),
        Index("ix_promotions_loop_decided", "loop_id", "decided_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    cycle_id: Mapped[int | None] = mapped_column(
        ForeignKey("cycles.id", ondelete="CASCADE"), unique=True
    )
    decision: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), server_default="decided")
    reason: Mapped[str] = mapped_column(Text)
    statistics: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    candidate_checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    previous_checkpoint_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"))
    serving_target: Mapped[dict[str, Any]] = mapped_column(JSON, server_default="{}")
    decided_by: Mapped[str] = mapped_column(String(64), server_default="gate")
    decided_at: Mapped[dt.datetime] = now_column()
    deployed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    canary_ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    rolled_back_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class LoopConfigVersion(Base):
    """One version of a loop's configuration: what it was set to, by whom, when.

    Every create, ``PATCH /v1/loops/{loop}`` and ``ratchet loop apply`` that changes
    something adds a row, so a loop's policies have a history like code has; the loop row
    holds the newest version, which the next cycle picks up.
    """

    __tablename__ = "loop_config_versions"
    __table_args__ = (UniqueConstraint("loop_id", "version"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    changes: Mapped[list[Any]] = mapped_column(JSON, server_default="[]")
    changed_by: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = now_column()


__all__ = [
    "Base",
    "Checkpoint",
    "Credential",
    "Cycle",
    "Dataset",
    "DatasetTask",
    "Evaluation",
    "EvaluationResult",
    "GatewayCall",
    "GatewayOutcome",
    "GatewaySession",
    "Loop",
    "LoopConfigVersion",
    "LshBucket",
    "OtlpPendingTrace",
    "OtlpSpan",
    "OtlpSpanPayload",
    "PartitionRetirement",
    "Promotion",
    "Run",
    "Task",
    "TaskSource",
    "Trace",
]


class TraceFeedback(Base):
    """What a user said about a trace after the fact (a score, a label, a correction), the
    convention of Langfuse's scores and LangSmith's feedback.

    ``content_hash`` is unique per trace, so posting the same feedback twice stores one row
    (a retrying client cannot double-count a verdict); different feedback adds a row.
    """

    __tablename__ = "trace_feedback"
    __table_args__ = (UniqueConstraint("trace_id", "content_hash"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    # No index of its own: the unique (trace_id, content_hash) index leads with it.
    trace_id: Mapped[int] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    score: Mapped[float | None] = mapped_column(Float)
    label: Mapped[str | None] = mapped_column(Text)
    correction: Mapped[str | None] = mapped_column(Text)
    comment: Mapped[str | None] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = now_column()


class ToolResponse(Base):
    """A loop's tool-response store: the result production got for one call, so the replay
    environment can answer the same call in any task of the loop (services.environments.
    replay). Keyed by tool name, tool schema hash and canonical arguments (their sha256):
    the first result recorded for a key is kept, later ones are the same call again.

    The reserved tool name ``<answer>`` (no real tool can have it: OpenAI names are
    ``[a-zA-Z0-9_-]``) keeps the final answer of a successful trace under its conversation
    key, the reference a later failure of the same conversation is scored against. The
    store's version is its newest row id; a dataset snapshot ships the rows up to it as a
    file and records the version in its manifest.
    """

    __tablename__ = "tool_responses"
    __table_args__ = (UniqueConstraint("loop_id", "tool", "schema_hash", "arguments_key"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    tool: Mapped[str] = mapped_column(String(64))
    schema_hash: Mapped[str] = mapped_column(String(16))
    arguments_key: Mapped[str] = mapped_column(String(64))
    arguments: Mapped[str] = mapped_column(Text)
    result: Mapped[str] = mapped_column(Text)
    trace_id: Mapped[int | None] = mapped_column(ForeignKey("traces.id", ondelete="SET NULL"))
    created_at: Mapped[dt.datetime] = now_column()


class ServingTenure(Base):
    """One version's time serving a loop, from its verified deploy to the deploy that
    replaced it, with the tokens and compute it served (services.loop.ledger).

    ``baseline`` is the server's counters for the version at the last sample (deltas are
    taken from it); at most one tenure per loop is open (``ended_at`` NULL)."""

    __tablename__ = "serving_tenures"
    __table_args__ = (
        Index(
            "uq_serving_tenures_one_open_per_loop",
            "loop_id",
            unique=True,
            postgresql_where=text("ended_at IS NULL"),
        ),
        Index("ix_serving_tenures_loop_started", "loop_id", "started_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    loop_id: Mapped[int] = mapped_column(ForeignKey("loops.id", ondelete="CASCADE"))
    checkpoint_id: Mapped[str] = mapped_column(ForeignKey("checkpoints.id"))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    busy_seconds: Mapped[float] = mapped_column(Float, server_default="0")
    cost_usd: Mapped[Decimal] = mapped_column(Numeric(14, 6), server_default="0")
    baseline: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[dt.datetime] = now_column()
    sampled_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


# Re-exported: every table is importable from here.
from services.db.models_demonstrations import Demonstration  # noqa: E402
from services.db.models_gateway import GatewayCall, GatewayOutcome, GatewaySession  # noqa: E402
from services.db.models_otlp import OtlpPendingTrace, OtlpSpan  # noqa: E402

__all__ = [
    "Checkpoint",
    "Credential",
    "Cycle",
    "Dataset",
    "DatasetTask",
    "Demonstration",
    "Evaluation",
    "EvaluationResult",
    "GatewayCall",
    "GatewayOutcome",
    "GatewaySession",
    "Loop",
    "LoopConfigVersion",
    "LshBucket",
    "OtlpPendingTrace",
    "OtlpSpan",
    "OtlpSpanPayload",
    "PartitionRetirement",
    "Promotion",
    "Run",
    "ServingTenure",
    "Task",
    "TaskSource",
    "ToolResponse",
    "Trace",
    "TraceBody",
    "TraceFeedback",
]

"""Wire models of the curated tasks and dataset snapshots the admin API lists and shows
(``ratchet tasks`` and ``ratchet datasets`` print them), separate from the tables."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Split = Literal["train", "eval", "heldout", "regression"]


class TaskPublic(BaseModel):
    """One curated task as a listing shows it: where it sits and how much it weighs."""

    id: int = Field(description="Row id (what `ratchet tasks show` takes)")
    environment: str
    split: Split
    origin: str = Field(description="failure, success, demonstration, ...: what made it")
    weight: int = Field(description="How many traces it stands for (duplicates add weight)")
    pinned: bool = Field(description="In the pinned regression suite (never trained on)")
    cluster_id: str
    content_hash: str = Field(description="Curation's dedup key")
    probe_pass_rate: float | None = Field(description="The champion's pass rate when probed")
    redactions: dict[str, Any] = Field(description="What redaction removed, by kind")
    prompt: str = Field(description="The task's prompt, as the model sees it")
    created_at: dt.datetime
    set_aside_reason: str | None = Field(
        default=None,
        description="Why the task is set aside (never trained on), e.g. unanswerable_calls: "
        "every episode needed a tool result nobody could give; null when it is not",
    )
    set_aside_detail: str | None = Field(default=None, description="What set it aside")
    set_aside_at: dt.datetime | None = None


class FactPublic(BaseModel):
    """One fact of a reference answer that the facts rule looks for in an answer."""

    kind: Literal["number", "time", "date", "code", "quote", "name"]
    value: str = Field(description="The normal form an answer's fact is compared by")
    text: str = Field(description="As the reference wrote it")


class RewardCheckPublic(BaseModel):
    """What a replay task's reward checks (docs/curation.md, "Rewards")."""

    rule: str = Field(
        description="facts, text, number, json_subset or regex (a rule decides), or judge "
        "(an LLM judge decides)"
    )
    facts: list[FactPublic] = Field(
        description="Under the facts rule: what an answer must state to pass"
    )
    judge: str | None = Field(
        description="The loop's judge endpoint: it decides (rule judge), or is compared with "
        "the rule on a sample"
    )


class TaskSourcePublic(BaseModel):
    """A trace behind a task: the first one (origin) or one deduplicated into it."""

    trace_id: int
    external_id: str
    relation: str


class TaskDetail(TaskPublic):
    """One task in full: its loop, spec (verifier, tools) and the traces it came from."""

    loop: str
    failure_signature: str | None
    spec: dict[str, Any]
    sources: list[TaskSourcePublic]
    check: RewardCheckPublic | None = Field(
        default=None, description="What the reward checks (replay tasks; null for others)"
    )


class TaskPage(BaseModel):
    """A page of a loop's tasks, newest first."""

    tasks: list[TaskPublic]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page"
    )


class PinIn(BaseModel):
    """Tasks to put into the loop's pinned regression suite."""

    model_config = ConfigDict(extra="forbid")

    task_ids: list[int] = Field(min_length=1, max_length=1000, description="Task row ids")


class PinResult(BaseModel):
    loop: str
    pinned: list[int] = Field(description="The tasks now in the regression suite")


class RestoreIn(BaseModel):
    """Set-aside tasks to bring back (the next snapshot may train on them)."""

    model_config = ConfigDict(extra="forbid")

    task_ids: list[int] = Field(min_length=1, max_length=1000, description="Task row ids")


class RestoreResult(BaseModel):
    loop: str
    restored: list[int] = Field(description="The tasks that were set aside and are no longer")


class DatasetPublic(BaseModel):
    """One immutable dataset snapshot: its counts and files."""

    id: int = Field(description="Row id (what `ratchet datasets show` takes)")
    content_hash: str
    train_count: int
    eval_count: int
    regression_count: int
    heldout_count: int
    train_uri: str
    eval_uri: str
    regression_uri: str | None
    heldout_uri: str | None
    replay_count: int = Field(
        default=0, description="Successes on the trained side, which train jobs replay"
    )
    replay_uri: str | None = None
    stats: dict[str, Any] = Field(description="Difficulty and split statistics")
    created_at: dt.datetime


class DatasetDetail(DatasetPublic):
    loop: str
    source_traces: int = Field(description="Distinct traces its tasks came from")


class DatasetPage(BaseModel):
    """A page of a loop's datasets, newest first."""

    datasets: list[DatasetPublic]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page"
    )


class DemonstrationPublic(BaseModel):
    """A stored episode of a task (a demonstration): what the model said and how it scored."""

    id: int
    passed: bool
    reward: float
    source: str = Field(description="The kind of run that sampled it: probe or train")
    run_id: str
    checkpoint_id: str | None = Field(description="The weights that sampled it")
    text: str = Field(description="The episode as the model's tokenizer reads it back")
    created_at: dt.datetime

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

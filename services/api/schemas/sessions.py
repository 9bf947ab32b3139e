"""Wire models of the capture gateway's session routes (close, outcome) and the loop page's
session listing."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.api.schemas.traces import NoNulText


class OutcomeIn(BaseModel):
    """What became of a session, known after the fact: at least one of ``success``,
    ``score``, ``reference_answer`` and ``label``."""

    model_config = ConfigDict(extra="forbid")

    success: bool | None = Field(default=None, description="Whether the episode succeeded")
    score: float | None = Field(
        default=None, allow_inf_nan=False, description="Outcome score, e.g. 0..1"
    )
    reference_answer: NoNulText | None = Field(
        default=None,
        min_length=1,
        max_length=100_000,
        description="What the final answer should have been",
    )
    label: NoNulText | None = Field(
        default=None, min_length=1, max_length=200, description="e.g. resolved, escalated"
    )

    @model_validator(mode="after")
    def _says_something(self) -> OutcomeIn:
        given = (self.success, self.score, self.reference_answer, self.label)
        if all(value is None for value in given):
            raise ValueError(
                "an outcome needs at least one of success, score, reference_answer and label"
            )
        return self


class OutcomeResult(BaseModel):
    """The answer to an outcome post."""

    id: int = Field(description="Row id of the stored outcome")
    session: str = Field(description="The session id the outcome was posted for")
    status: Literal["applied", "waiting"] = Field(
        description="applied: the session's trace has it (as feedback; the trace goes back to "
        "curation); waiting: the session is open or not yet known, and the outcome joins it "
        "when it closes"
    )
    trace_id: int | None = Field(default=None, description="The session's trace, once closed")


class SessionClosed(BaseModel):
    """The answer to a close."""

    session: str
    session_id: int
    status: Literal["closed", "already_closed"]
    calls: int
    trace_id: int | None = Field(description="The trace the session became (null: no calls)")
    external_id: str


class SessionPublic(BaseModel):
    """One session on the loop page."""

    id: int
    key: str
    status: Literal["open", "closed"]
    calls: int
    opened_at: dt.datetime
    last_call_at: dt.datetime
    closed_at: dt.datetime | None
    close_reason: str | None
    trace_id: int | None
    success: bool | None
    score: float | None
    label: str | None

"""Wire models of the webhook's answers (its request schema is services.ingest.schema), of
feedback on a trace, and of the traces listing."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from services.api.schemas.tasks import RewardCheckPublic


class FieldError(BaseModel):
    path: str = Field(description="Dotted path of the field at fault, e.g. messages.0.role")
    message: str


class TraceWarningPublic(BaseModel):
    """An accepted trace that curation will reject, or cannot learn all of
    (services.ingest.warnings lists the codes)."""

    code: str = Field(description="no_tools, unlisted_tool", examples=["no_tools"])
    path: str = Field(description="Dotted path of the field it is about, e.g. tools")
    message: str


class ItemResult(BaseModel):
    """What happened to one trace of the request."""

    index: int = Field(description="Position of the trace in the request (0 for a single one)")
    external_id: str | None
    status: Literal["accepted", "duplicate", "rejected"] = Field(
        description="accepted: stored now; duplicate: already stored, nothing changed; "
        "rejected: not stored, see reason"
    )
    trace_id: int | None = Field(
        default=None,
        description="Row id of the stored trace: the new row, or for a duplicate the one "
        "stored before",
    )
    reason: str | None = None
    fields: list[FieldError] = Field(default_factory=list)
    warnings: list[TraceWarningPublic] = Field(
        default_factory=list,
        description="For an accepted trace: what the loop's curation will make of it that "
        "the sender should know, e.g. no_tools (a replay loop rejects it)",
    )


class IngestResult(BaseModel):
    """The answer to a webhook post; sent only after the accepted traces are committed."""

    accepted: int
    duplicates: int
    rejected: int
    results: list[ItemResult]


def _no_nul(value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise ValueError("may not contain NUL (\\u0000) characters")
    return value


NoNulText = Annotated[str, AfterValidator(_no_nul)]


class FeedbackIn(BaseModel):
    """Feedback on a trace after the fact: a score, a label, a correction, a comment.

    At least one of score, label and correction: a comment alone says nothing a reward can
    use. ``id`` is the client's idempotency key: feedback re-posted with the same id is the
    same feedback (a no-op), and the same id with different content is a 409. Without an id,
    identical content is the same feedback. ``external_id`` names the trace, as the URL
    does: the signature covers the body, so a signed feedback cannot be replayed onto another
    trace's URL (issue 43).
    """

    model_config = ConfigDict(extra="forbid")

    external_id: NoNulText = Field(
        min_length=1,
        max_length=256,
        description="The trace the feedback is about, as in the URL: the signature covers it",
    )
    id: NoNulText | None = Field(
        default=None, min_length=1, max_length=256, description="Client id (idempotency key)"
    )
    score: float | None = Field(
        default=None, allow_inf_nan=False, description="Outcome score, e.g. 0..1 or -1/1"
    )
    label: NoNulText | None = Field(
        default=None, min_length=1, max_length=200, description="e.g. correct, wrong, helpful"
    )
    correction: NoNulText | None = Field(
        default=None,
        min_length=1,
        max_length=100_000,
        description="What the answer should have been (used as a reference answer)",
    )
    comment: NoNulText | None = Field(default=None, max_length=10_000)

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackIn:
        if self.score is None and self.label is None and self.correction is None:
            raise ValueError("feedback needs at least one of score, label and correction")
        return self


class FeedbackResult(BaseModel):
    """The answer to a feedback post."""

    id: int = Field(description="Row id of the stored feedback")
    external_id: str = Field(description="The trace the feedback is about")
    status: Literal["accepted", "duplicate"] = Field(
        description="accepted: stored now, the trace goes back to curation; duplicate: the "
        "same feedback was stored before, nothing changed"
    )


class FeedbackPublic(BaseModel):
    id: int
    score: float | None
    label: str | None
    correction: str | None
    comment: str | None
    created_at: dt.datetime


class TraceTaskPublic(BaseModel):
    """A task the trace became (relation origin) or was counted into as a duplicate."""

    task_id: int
    relation: Literal["origin", "duplicate", "near_duplicate"]
    environment: str
    split: str
    origin: str


CurationOutcome = Literal["pending", "task", "duplicate", "rejected", "skipped"]
ReportedOutcome = Literal["success", "failure", "unknown"]


class TraceListFilters(BaseModel):
    """The traces listing's filters, read from the query string (``GET
    /v1/loops/{loop}/traces``); a filter left out matches any trace."""

    outcome: ReportedOutcome | None = Field(default=None, description="What the agent reported")
    curation: CurationOutcome | None = Field(
        default=None, description="What curation made of the trace"
    )
    reason: str | None = Field(
        default=None,
        max_length=1000,
        description="Rejection reason code, e.g. unknown_api_version",
    )
    since: dt.datetime | None = Field(default=None, description="Received at or after")
    until: dt.datetime | None = Field(default=None, description="Received before")


class TraceSummaryPublic(BaseModel):
    """One trace in the listing: what the agent reported and what curation made of it."""

    external_id: str
    model_version: str | None
    outcome: ReportedOutcome = Field(
        description="failure: success false or an error kind; success: success true and no "
        "error; unknown: neither reported"
    )
    success: bool | None
    score: float | None
    error_kind: str | None
    received_at: dt.datetime
    curated_at: dt.datetime | None
    curation_outcome: CurationOutcome = Field(
        description="pending: not curated yet; task: became a task; duplicate: counted into "
        "an existing task; rejected: refused (see reason); skipped: not a failure to learn "
        "from (see reason)"
    )
    reason: str | None = Field(
        description="The reason code of a rejection (e.g. unknown_api_version), or why it "
        "was skipped"
    )
    curation_detail: str | None = Field(description="Curation's full verdict, in a sentence")
    body_purged: bool = Field(
        default=False,
        description="Retention dropped the raw body (RATCHET_TRACE_RETENTION_DAYS); the row, "
        "its outcome and its tasks stay, feedback on it is refused",
    )
    check: RewardCheckPublic | None = Field(
        default=None,
        description="What the reward of the trace's task checks (its facts under the facts "
        "rule); null when the trace became no task",
    )


class TracePage(BaseModel):
    """A page of traces, newest first; pass ``next_cursor`` as ``cursor`` for the next."""

    traces: list[TraceSummaryPublic]
    next_cursor: str | None = Field(description="None on the last page")


class TraceDetail(TraceSummaryPublic):
    """One trace with the tasks it became, its feedback and its body as stored."""

    tasks: list[TraceTaskPublic]
    feedback: list[FeedbackPublic]
    body: dict[str, Any] | None = Field(
        description="The ratchet.trace/v1 document (None once retention purged it)"
    )
    body_purged_at: dt.datetime | None


class CurationCountPublic(BaseModel):
    """How many of a loop's traces had one curation outcome and reason, with an example."""

    outcome: CurationOutcome
    reason: str | None
    count: int
    example_external_id: str

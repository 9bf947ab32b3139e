"""Wire models of the webhook's answers (the request schema is services.ingest.schema)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class FieldError(BaseModel):
    path: str = Field(description="Dotted path of the field at fault, e.g. messages.0.role")
    message: str


class ItemResult(BaseModel):
    """What happened to one trace of the request."""

    index: int = Field(description="Position of the trace in the request (0 for a single one)")
    external_id: str | None
    status: Literal["accepted", "duplicate", "rejected"] = Field(
        description="accepted: stored now; duplicate: already stored, nothing changed; "
        "rejected: not stored, see reason"
    )
    trace_id: int | None = Field(default=None, description="Row id of a newly stored trace")
    reason: str | None = None
    fields: list[FieldError] = Field(default_factory=list)


class IngestResult(BaseModel):
    """The answer to a webhook post; sent only after the accepted traces are committed."""

    accepted: int
    duplicates: int
    rejected: int
    results: list[ItemResult]

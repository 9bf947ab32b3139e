"""Payloads of the retention workflow (trace bodies purged on a schedule)."""

from __future__ import annotations

from dataclasses import dataclass

RETENTION_SCHEDULE_ID = "ratchet-retention"


RETENTION_WORKFLOW_ID = "retention/purge"


@dataclass
class RetentionInput:
    """One purge of raw trace bodies received more than ``retention_days`` ago."""

    retention_days: int
    batch_size: int = 1000


@dataclass
class RetentionResult:
    purged: int = 0
    cutoff: str = ""


@dataclass
class PurgeTraceBodiesInput:
    retention_days: int
    now: str  # ISO 8601, fixed by the workflow so retries use the same cutoff
    batch_size: int = 1000


@dataclass
class PurgeTraceBodiesResult:
    purged: int = 0
    cutoff: str = ""

"""Payloads of the retention workflow (partitions made ahead and trace bodies purged on a
schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field

RETENTION_SCHEDULE_ID = "ratchet-retention"


RETENTION_WORKFLOW_ID = "retention/purge"


@dataclass
class RetentionInput:
    """One run of upkeep: partitions made ``ahead`` periods ahead, span payloads of spans
    assembled ``span_retention_s`` ago dropped, and raw trace bodies received more than
    ``retention_days`` ago purged (0: kept for ever). The defaults are those of runs
    scheduled before the partitions existed."""

    retention_days: int
    batch_size: int = 1000
    period: str = "daily"  # RATCHET_PARTITION_PERIOD
    ahead: int = 3  # RATCHET_PARTITIONS_AHEAD
    span_retention_s: int = 86_400


@dataclass
class RetentionResult:
    purged: int = 0
    cutoff: str = ""
    partitions_made: list[str] = field(default_factory=list)
    partitions_retired: list[str] = field(default_factory=list)


@dataclass
class MaintainPartitionsInput:
    now: str  # ISO 8601, fixed by the workflow so retries make and retire the same
    period: str
    ahead: int
    span_retention_s: int


@dataclass
class MaintainPartitionsResult:
    made: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)


@dataclass
class PurgeTraceBodiesInput:
    retention_days: int
    now: str  # ISO 8601, fixed by the workflow so retries use the same cutoff
    batch_size: int = 1000


@dataclass
class PurgeTraceBodiesResult:
    purged: int = 0
    cutoff: str = ""
    retired: list[str] = field(default_factory=list)

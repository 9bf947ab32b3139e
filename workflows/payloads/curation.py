"""Payloads of curation: CurateWorkflow's input and result and its activities' (batches,
snapshots, drift, pending work)."""

from __future__ import annotations

from dataclasses import dataclass

from services.curation.results import CurationCounts, DatasetFiles

# Traces per curate_batch. A batch's Postgres round trips (lock, lookups, COPYs) cost about
# the same for 500 traces as for 2,000, so bigger batches amortise them: on 2 idle cores
# 2,000 curates 100k traces at 2,878/s against 2,229/s for 500 (docs/curation.md).
CURATION_BATCH_SIZE = 2000


@dataclass
class CurateInput:
    loop: str
    batch_size: int = CURATION_BATCH_SIZE
    max_batches: int = 1000


@dataclass
class CurateResult(CurationCounts):
    """A curate workflow's batches, their counts summed."""


@dataclass
class CurateBatchInput:
    loop: str
    batch_size: int = CURATION_BATCH_SIZE


@dataclass
class CurateBatchResult(CurationCounts):
    """One batch's counts; ``more``: the batch was full, so traces may be left to curate."""

    more: bool = False


@dataclass
class SnapshotInput:
    loop: str
    cycle: int


@dataclass
class SnapshotResult(DatasetFiles):
    """The dataset ``snapshot_dataset`` froze (or found already frozen) for a cycle."""


@dataclass
class DriftInput:
    loop: str


@dataclass
class DriftResult:
    failure_rate: float
    window: int
    threshold: float
    drifted: bool
    model_version: str | None = None


@dataclass
class PendingWorkInput:
    loop: str


@dataclass
class PendingWorkResult:
    """What a trigger decision needs: curated-but-untrained tasks and uncurated traces."""

    new_train_tasks: int
    uncurated_traces: int

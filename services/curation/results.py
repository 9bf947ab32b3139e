"""What curation hands back: the counts of a batch, the dataset a snapshot froze.

The domain's results (``pipeline.BatchReport``, ``snapshot.DatasetSnapshot``) and the
activity and workflow payloads that carry them (``CurateBatchResult``, ``CurateResult``,
``SnapshotResult`` in workflows.payloads) extend these classes, so each concept is declared
once and a field added here travels all the way. Standard library only: workflow payloads
inherit from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class CurationCounts:
    """Traces seen and what became of them: a task, a duplicate, a rejection or a skip."""

    traces_seen: int = 0
    tasks_created: int = 0
    duplicates: int = 0
    rejected: int = 0
    skipped: int = 0
    new_train_tasks: int = 0

    def add(self, other: CurationCounts) -> None:
        """Add ``other``'s counters to these (a workflow summing its batches)."""
        for counter in fields(CurationCounts):
            setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))


@dataclass
class DatasetFiles:
    """A dataset as the loop sees it: ids, counts and file URIs."""

    dataset_id: int
    content_hash: str
    train_count: int
    eval_count: int
    regression_count: int
    train_uri: str
    eval_uri: str
    regression_uri: str | None = None
    # The difficulty filter's counts over train candidates (``datasets.stats.difficulty``):
    # kept, too_easy, too_hard, unprobed.
    difficulty: dict[str, int] = field(default_factory=dict)
    # The frozen held-out set (all curated traffic, never trained on): points gained.
    heldout_count: int = 0
    heldout_uri: str | None = None
    # Successes on the trained side (services.curation.splits): what train jobs replay.
    replay_count: int = 0
    replay_uri: str | None = None

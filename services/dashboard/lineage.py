"""Lineage of the serving model, answered in one SQL query (DESIGN §2).

Which traces → which tasks → which dataset → which run → which checkpoint → which promotion
is serving now. The chain is a walk over foreign keys, from ``loops.champion_checkpoint_id``
back through the checkpoint's producing run, that run's dataset, the dataset's tasks and
their source traces, plus the promotion that put the checkpoint in service and the
checkpoint's ancestry (``parent_id`` chain).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import text
from sqlalchemy.orm import Session

# The parent chain is bounded so a corrupt cycle in it cannot make the query run forever.
MAX_ANCESTRY = 64

_LINEAGE_SQL = text(
    """
WITH RECURSIVE serving AS (
    SELECT l.id AS loop_id, l.champion_checkpoint_id AS checkpoint_id
    FROM loops l
    WHERE l.id = :loop_id AND l.champion_checkpoint_id IS NOT NULL
),
ancestry (id, parent_id, depth) AS (
    SELECT c.id, c.parent_id, 0
    FROM checkpoints c JOIN serving s ON c.id = s.checkpoint_id
    UNION ALL
    SELECT p.id, p.parent_id, a.depth + 1
    FROM checkpoints p JOIN ancestry a ON p.id = a.parent_id
    WHERE a.depth < :max_ancestry
)
SELECT
    ck.id AS checkpoint_id, ck.uri AS checkpoint_uri, ck.format AS checkpoint_format,
    ck.size_bytes AS checkpoint_size_bytes, ck.created_at AS checkpoint_created_at,
    (SELECT array_agg(a.id ORDER BY a.depth) FROM ancestry a) AS ancestry,
    r.id AS run_id, r.status AS run_status, r.executor AS run_executor,
    r.cost_usd AS run_cost_usd, r.compute_seconds AS run_compute_seconds,
    r.ended_at AS run_ended_at,
    d.id AS dataset_id, d.content_hash AS dataset_hash, d.train_count, d.eval_count,
    d.regression_count, d.replay_count, d.created_at AS dataset_created_at,
    tasks.task_count, tasks.cluster_count,
    traces.trace_count, traces.failed_trace_count, traces.first_received_at,
    traces.last_received_at,
    p.id AS promotion_id, p.decision, p.status AS promotion_status, p.reason,
    p.decided_by, p.decided_at, p.deployed_at, cy.number AS cycle_number
FROM serving s
JOIN checkpoints ck ON ck.id = s.checkpoint_id
LEFT JOIN runs r ON r.id = ck.run_id
LEFT JOIN datasets d ON d.id = r.dataset_id
LEFT JOIN LATERAL (
    SELECT count(*) AS task_count, count(DISTINCT t.cluster_id) AS cluster_count
    FROM dataset_tasks dt JOIN tasks t ON t.id = dt.task_id
    WHERE dt.dataset_id = d.id
) tasks ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS trace_count,
           count(*) FILTER (WHERE tr.success IS FALSE) AS failed_trace_count,
           min(tr.received_at) AS first_received_at,
           max(tr.received_at) AS last_received_at
    FROM traces tr
    WHERE tr.id IN (
        SELECT ts.trace_id
        FROM dataset_tasks dt JOIN task_sources ts ON ts.task_id = dt.task_id
        WHERE dt.dataset_id = d.id
    )
) traces ON true
LEFT JOIN LATERAL (
    SELECT *
    FROM promotions pr
    WHERE pr.loop_id = s.loop_id AND pr.candidate_checkpoint_id = ck.id
      AND pr.decision = 'promote'
    ORDER BY pr.decided_at DESC
    LIMIT 1
) p ON true
LEFT JOIN cycles cy ON cy.id = p.cycle_id
"""
)


@dataclass(frozen=True)
class Lineage:
    """The serving checkpoint and everything it came from; ``None`` fields are missing links
    (a base checkpoint has no run, a run may predate datasets, and so on)."""

    checkpoint_id: str
    checkpoint_uri: str
    checkpoint_format: str
    checkpoint_size_bytes: int
    checkpoint_created_at: dt.datetime
    ancestry: list[str]
    run_id: str | None
    run_status: str | None
    run_executor: str | None
    run_cost_usd: Decimal | None
    run_compute_seconds: float | None
    run_ended_at: dt.datetime | None
    dataset_id: int | None
    dataset_hash: str | None
    train_count: int | None
    eval_count: int | None
    regression_count: int | None
    replay_count: int | None
    dataset_created_at: dt.datetime | None
    task_count: int
    cluster_count: int
    trace_count: int
    failed_trace_count: int
    first_received_at: dt.datetime | None
    last_received_at: dt.datetime | None
    promotion_id: int | None
    decision: str | None
    promotion_status: str | None
    reason: str | None
    decided_by: str | None
    decided_at: dt.datetime | None
    deployed_at: dt.datetime | None
    cycle_number: int | None

    @property
    def parents(self) -> list[str]:
        """Ancestors of the serving checkpoint, nearest first."""
        return self.ancestry[1:]


def serving_lineage(*, session: Session, loop_id: int) -> Lineage | None:
    """The lineage of the loop's champion, or ``None`` when the loop has no champion."""
    row = (
        session.execute(_LINEAGE_SQL, {"loop_id": loop_id, "max_ancestry": MAX_ANCESTRY})
        .mappings()
        .one_or_none()
    )
    if row is None:
        return None
    values = dict(row)
    values["ancestry"] = list(values["ancestry"] or [])
    for count in ("task_count", "cluster_count", "trace_count", "failed_trace_count"):
        values[count] = int(values[count] or 0)
    return Lineage(**values)

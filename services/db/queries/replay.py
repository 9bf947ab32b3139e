"""Rows the replay environment's curation reads and writes: the loop's tool-response store
and the feedback posted on traces.

Every function takes the session keyword-only and never commits. Feedback is read with
plain SQL against ``trace_feedback`` (the table the feedback API writes, migration 0007):
curation only reads it, and the newest row of a trace is what counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from services.db.models import ToolResponse
from services.environments.replay.records import RecordedCall, arguments_key

ANSWER_TOOL = "<answer>"  # see ToolResponse: a successful trace's answer, by conversation


@dataclass(frozen=True)
class Feedback:
    """The newest feedback on one trace."""

    score: float | None
    label: str | None
    correction: str | None
    comment: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "label": self.label,
            "correction": self.correction,
            "comment": self.comment,
        }


def record_tool_responses(
    *, session: Session, loop_id: int, rows: Sequence[tuple[RecordedCall, int | None]]
) -> None:
    """Add recorded calls (with the trace each came from) to the loop's store; a key already
    stored keeps its first result."""
    if not rows:
        return
    values = [
        {
            "loop_id": loop_id,
            "tool": call.tool,
            "schema_hash": call.schema_hash,
            "arguments_key": arguments_key(call.arguments),
            "arguments": call.arguments,
            "result": call.result,
            "trace_id": trace_id,
        }
        for call, trace_id in rows
    ]
    session.execute(
        insert(ToolResponse)
        .values(values)
        .on_conflict_do_nothing(
            index_elements=[
                ToolResponse.loop_id,
                ToolResponse.tool,
                ToolResponse.schema_hash,
                ToolResponse.arguments_key,
            ]
        )
    )


def success_answers(*, session: Session, loop_id: int, keys: Sequence[str]) -> dict[str, str]:
    """The stored answer of a successful trace for each conversation key that has one."""
    if not keys:
        return {}
    rows = session.execute(
        select(ToolResponse.arguments, ToolResponse.result).where(
            ToolResponse.loop_id == loop_id,
            ToolResponse.tool == ANSWER_TOOL,
            ToolResponse.arguments.in_(sorted(set(keys))),
        )
    ).all()
    return {key: answer for key, answer in rows}


def tool_store_version(*, session: Session, loop_id: int) -> int:
    """The loop's store version: its newest row id, 0 when empty."""
    return int(
        session.execute(
            select(func.coalesce(func.max(ToolResponse.id), 0)).where(
                ToolResponse.loop_id == loop_id
            )
        ).scalar_one()
    )


def tool_store(*, session: Session, loop_id: int) -> tuple[int, list[RecordedCall]]:
    """The loop's store as it is now: its version (newest row id, 0 when empty) and every
    recorded tool call (answers excluded), in key order."""
    version = tool_store_version(session=session, loop_id=loop_id)
    rows = session.execute(
        select(
            ToolResponse.tool, ToolResponse.schema_hash, ToolResponse.arguments, ToolResponse.result
        )
        .where(ToolResponse.loop_id == loop_id, ToolResponse.tool != ANSWER_TOOL)
        .order_by(ToolResponse.tool, ToolResponse.schema_hash, ToolResponse.arguments)
    ).all()
    return int(version), [RecordedCall(*row) for row in rows]


def tool_schemas(*, session: Session, loop_id: int, dataset_id: int | None) -> list[Any]:
    """Every distinct tool (as the task specs list it) of a dataset's tasks, or of the
    loop's tasks without one: a few rows however many tasks share them."""
    scope = (
        "JOIN dataset_tasks AS d ON d.task_id = t.id AND d.dataset_id = :dataset_id"
        if dataset_id is not None
        else ""
    )
    rows = session.execute(
        text(
            "SELECT DISTINCT tool FROM tasks AS t "
            f"{scope} "
            "CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(t.spec->'tools') "
            "= 'array' THEN t.spec->'tools' ELSE '[]'::jsonb END) AS tool "
            "WHERE t.loop_id = :loop_id"
        ),
        {"loop_id": loop_id, "dataset_id": dataset_id},
    ).scalars()
    return list(rows)


def latest_feedback(*, session: Session, trace_ids: Sequence[int]) -> dict[int, Feedback]:
    """The newest feedback of each trace that has any."""
    if not trace_ids:
        return {}
    rows = session.execute(
        text(
            "SELECT DISTINCT ON (trace_id) trace_id, score, label, correction, comment "
            "FROM trace_feedback WHERE trace_id = ANY(:ids) "
            "ORDER BY trace_id, created_at DESC, id DESC"
        ),
        {"ids": list(trace_ids)},
    ).all()
    return {int(row[0]): Feedback(row[1], row[2], row[3], row[4]) for row in rows}

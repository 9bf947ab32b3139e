"""Helpers for curation tests: a tiny environment, loops and traces in a real Postgres."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import insert, select

from services.curation.pipeline import curate_batch
from services.curation.policy import CurationPolicy
from services.curation.workers import PreparePool
from services.db.models import Loop, Trace, TraceBody
from services.db.session import SessionFactory
from services.environments.base import TRACE_SCHEMA, Rejection, TaskSpec

QA = "qa"


class QaAdapter:
    """A question-answer environment: the task is the user's question, the verifier checks
    the answer in ``metadata.answer``. ``metadata.explode`` makes the adapter raise."""

    name = QA

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        metadata = trace.get("metadata") or {}
        if metadata.get("explode"):
            raise RuntimeError("adapter bug")
        question = next(
            (m.get("content") for m in trace["messages"] if m.get("role") == "user"), None
        )
        if not isinstance(question, str) or not question.strip():
            return Rejection("no_user_message", "no question")
        answer = metadata.get("answer")
        if answer is None:
            return Rejection("no_answer", "this trace carries no checkable answer")
        return TaskSpec.create(
            environment=QA,
            prompt=f"Answer the question.\nuser: {question}\n",
            tools=list(trace.get("tools") or []),
            verifier={"reward_id": "qa/exact", "params": {"answer": str(answer)}},
            reference_answer=metadata.get("reference"),
            metadata={"note": metadata.get("note", "")},
        )


def qa_resolver(name: str) -> QaAdapter:
    if name != QA:
        raise ValueError(f"unknown environment {name!r} (known: {QA})")
    return QaAdapter()


def trace_body(
    external_id: str,
    question: str,
    *,
    answer: str | None = "42",
    success: bool | None = False,
    score: float | None = None,
    error_kind: str | None = "wrong_answer",
    model_version: str = "m1",
    metadata: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """A ``ratchet.trace/v1`` document as an agent runtime would post it."""
    meta: dict[str, Any] = {"answer": answer, **dict(metadata or {})}
    return {
        "schema": TRACE_SCHEMA,
        "external_id": external_id,
        "model_version": model_version,
        "tools": list(tools or [{"name": "search", "description": "search the docs"}]),
        "messages": [
            {"role": "system", "content": "You are a support agent."},
            {"role": "user", "content": question},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": "search", "arguments": {"q": question}}],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "search", "content": "no result"},
            {"role": "assistant", "content": "I do not know"},
        ],
        "outcome": {
            "success": success,
            "score": score,
            "error": {"kind": error_kind, "message": "failed"} if error_kind else None,
        },
        "reference_answer": None,
        "metadata": meta,
    }


def make_loop(
    session_factory: SessionFactory,
    name: str = "support",
    *,
    environment: str = QA,
    curation_policy: Mapping[str, Any] | None = None,
    trigger_policy: Mapping[str, Any] | None = None,
) -> int:
    with session_factory.begin() as session:
        loop = Loop(
            name=name,
            environment=environment,
            curation_policy=dict(curation_policy or {}),
            trigger_policy=dict(trigger_policy or {}),
        )
        session.add(loop)
        session.flush()
        return loop.id


def add_traces(
    session_factory: SessionFactory, loop_id: int, bodies: Iterable[Any], *, size: int | None = None
) -> list[int]:
    """Insert traces the way ingest stores them (outcome columns extracted from the body)."""
    rows = []
    bodies_list = list(bodies)
    for index, body in enumerate(bodies_list):
        outcome = body.get("outcome") or {} if isinstance(body, dict) else {}
        error = outcome.get("error") or {}
        rows.append(
            {
                "loop_id": loop_id,
                "external_id": (body.get("external_id") if isinstance(body, dict) else None)
                or f"raw-{index}",
                "model_version": body.get("model_version") if isinstance(body, dict) else None,
                "success": outcome.get("success"),
                "score": outcome.get("score"),
                "error_kind": error.get("kind"),
                "size_bytes": size if size is not None else len(json.dumps(body)),
            }
        )
    with session_factory.begin() as session:
        result = session.execute(
            insert(Trace).returning(Trace.id, Trace.received_at, sort_by_parameter_order=True),
            rows,
        ).all()
        session.execute(
            insert(TraceBody),
            [
                {"trace_id": trace_id, "received_at": at, "body": body}
                for (trace_id, at), body in zip(result, bodies_list, strict=True)
            ],
        )
        return [row[0] for row in result]


def traces_by_id(session_factory: SessionFactory, ids: Sequence[int]) -> dict[int, Trace]:
    with session_factory() as session:
        rows = session.scalars(select(Trace).where(Trace.id.in_(list(ids)))).all()
        return {row.id: row for row in rows}


def curate_all(
    session_factory: SessionFactory,
    loop_id: int,
    *,
    adapter: Any | None = None,
    limit: int = 50,
    pool: PreparePool | None = None,
) -> None:
    """Curate the loop in batches of ``limit`` until no uncurated trace is left."""
    while True:
        with session_factory.begin() as session:
            loop = session.get(Loop, loop_id)
            assert loop is not None
            report = curate_batch(
                session,
                loop=loop,
                policy=CurationPolicy.from_json(loop.curation_policy),
                adapter=adapter if adapter is not None else QaAdapter(),
                limit=limit,
                pool=pool,
            )
        if not report.more:
            return


WORDS = [
    *("order", "refund", "invoice", "password", "account", "login", "delivery", "address"),
    *("parcel", "broken", "missing", "late", "export", "report", "timeout", "plan", "premium"),
    *("cancel", "upgrade", "billing", "card", "charge", "twice", "email", "phone", "reset"),
    *("link", "expired", "warehouse", "courier", "tracking", "label", "customs", "return"),
    *("exchange", "size", "colour"),
]


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=9)) + f" #{i}" for i in range(n)]

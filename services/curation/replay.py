"""What curation adds to a batch beyond the trace bodies: feedback, and for replay loops the
tool-response store and the answers of successful traces.

Before the per-trace work (:mod:`.workers`), the batch reads the newest feedback of each
of its traces (``trace_feedback``, posted after the fact), and, for a loop whose environment
is ``replay``,

- adds every recorded tool call of every trace of the batch (whatever its verdict: a
  success's calls answer a later failure's as well) to the loop's store, redacted as tasks
  are, so any task of the loop can replay them;
- keeps the final answer of each successful trace (the runtime's ``outcome.success``, or
  positive feedback, unless feedback says otherwise) under its conversation key, and hands
  a failing trace of the same conversation that answer as its reference.

The result is one small object per trace, passed to the adapter under the trace's
``ratchet`` key (which the ingest schema refuses from clients) together with the loop's
reward settings; the feedback also decides the trace's outcome for selection (a user who
says an answer was wrong has made it a failure).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session

from services.curation.policy import CurationPolicy
from services.curation.redaction import Redactor
from services.db.queries import replay as replay_queries
from services.db.queries.traces import TraceRow
from services.environments.replay.env import ENVIRONMENT_NAME, conversation_key
from services.environments.replay.records import RecordedCall, recorded_calls
from services.environments.replay.rewards import feedback_is_positive, final_answer


def batch_contexts(
    session: Session,
    *,
    loop_id: int,
    environment: str,
    policy: CurationPolicy,
    traces: Sequence[TraceRow],
    redactor: Redactor,
) -> dict[int, dict[str, Any]]:
    """The ``ratchet`` object of each trace of the batch that has one (see the module)."""
    feedback = replay_queries.latest_feedback(session=session, trace_ids=[t.id for t in traces])
    if environment != ENVIRONMENT_NAME:
        return {trace_id: {"feedback": fb.to_dict()} for trace_id, fb in feedback.items()}
    bodies = {
        trace.id: json.loads(trace.body_json) for trace in traces if trace.body_json is not None
    }
    keys = {trace_id: conversation_key(body) for trace_id, body in bodies.items()}
    rows: list[tuple[RecordedCall, int | None]] = []
    for trace_id, body in bodies.items():
        for call in recorded_calls(body):
            rows.append((_redacted(call, redactor), trace_id))
        answer = _success_answer(body, feedback.get(trace_id))
        key = keys[trace_id]
        if answer is not None and key is not None:
            # The key is a digest, not text: redacting it would only lose it.
            clean = redactor.redact_text(answer, Counter())
            rows.append((RecordedCall(replay_queries.ANSWER_TOOL, "", key, clean), trace_id))
    replay_queries.record_tool_responses(session=session, loop_id=loop_id, rows=rows)
    answers = replay_queries.success_answers(
        session=session, loop_id=loop_id, keys=[k for k in keys.values() if k is not None]
    )
    settings = policy.replay_settings()
    contexts: dict[int, dict[str, Any]] = {}
    for trace in traces:
        key = keys[trace.id]
        fb = feedback.get(trace.id)
        contexts[trace.id] = {
            "policy": settings,
            "feedback": fb.to_dict() if fb is not None else None,
            "success_answer": answers.get(key) if key is not None else None,
        }
    return contexts


def feedback_outcome(context: Mapping[str, Any] | None) -> bool | None:
    """Whether a trace's feedback says it succeeded (True), failed (False), or neither."""
    feedback = (context or {}).get("feedback")
    return feedback_is_positive(feedback) if isinstance(feedback, Mapping) else None


def _success_answer(body: Any, feedback: replay_queries.Feedback | None) -> str | None:
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        return None
    verdict = feedback_is_positive(feedback.to_dict()) if feedback is not None else None
    outcome = body.get("outcome")
    succeeded = (
        verdict
        if verdict is not None
        else isinstance(outcome, Mapping) and outcome.get("success") is True
    )
    return final_answer(body["messages"]) if succeeded else None


def _redacted(call: RecordedCall, redactor: Redactor) -> RecordedCall:
    return RecordedCall(
        call.tool,
        call.schema_hash,
        redactor.redact_text(call.arguments, Counter()),
        redactor.redact_text(call.result, Counter()),
    )

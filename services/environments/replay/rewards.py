"""Which reward a replay task gets: the most trusted source a trace allows (docs/curation.md,
"Rewards"): a reference answer (a feedback correction, the trace's own, a positively rated or
successful answer, a successful trace of the same conversation) checked by a stated rule
(``facts`` by default), else an LLM judge when the loop names one, else none (the trace is
rejected with the reason). Curation reads the same answers and feedback verdicts through
:func:`final_answer` and :func:`feedback_is_positive`, so the two agree on what a trace says.
How a task is scored from what this chose is :mod:`.scoring`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from services.environments.base import Rejection
from services.environments.replay import matching
from services.environments.replay.facts import MAX_FACTS, extract_facts

POSITIVE_LABELS = frozenset(
    {"good", "correct", "positive", "pass", "passed", "success", "thumbs_up", "up", "accept"}
)


def final_answer(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The content of the trace's last assistant message, when it made no tool call."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            if message.get("tool_calls") or not isinstance(content, str) or not content.strip():
                return None
            return content
    return None


def feedback_is_positive(feedback: Mapping[str, Any]) -> bool | None:
    """True/False when feedback says the answer was right/wrong; None when it does not say.

    A score counts first (>= 0.5 is positive, as the selection's failure threshold reads
    scores); a label counts when it is one of :data:`POSITIVE_LABELS` (positive) or any
    other word (negative).
    """
    score = feedback.get("score")
    if isinstance(score, int | float) and not isinstance(score, bool):
        return float(score) >= 0.5
    label = feedback.get("label")
    if isinstance(label, str) and label.strip():
        return label.strip().lower().replace(" ", "_").replace("-", "_") in POSITIVE_LABELS
    return None


def json_object(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else an empty one (optional trace fields)."""
    return value if isinstance(value, Mapping) else {}


def choose_reward(
    trace: Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> tuple[dict[str, Any], str | None] | Rejection:
    """The most trusted reward the trace allows (docs/curation.md, "Rewards"), or why none.

    A reference answer is checked by its rule; under ``facts`` (the default) its facts are
    extracted here, once, and stored in the rule. Where the loop names a judge it rides
    along (``judge``): the rule decides, the judge is compared with it on a sample. A
    reference with no checkable fact goes to the judge (which then sees the reference) or
    is refused: a rule that passes every answer teaches nothing.
    """
    metadata = json_object(trace.get("metadata"))
    try:
        rule = matching.parse_rule(
            metadata.get("reference_match", settings.get("reference_match", matching.DEFAULT_RULE)),
            where="metadata.reference_match",
        )
    except matching.MatchRuleError as exc:
        return Rejection("bad_reference_match", str(exc))
    judge = _judge_spec(settings)
    found = _reference(trace, messages, context)
    if found is None:
        if judge is not None:
            return {"kind": "judge", **judge}, None
        return Rejection(
            "no_reward_source",
            "nothing can score this trace: no reference_answer, no feedback with a correction "
            "or a positive score, no successful trace of the same conversation, and the loop "
            "names no judge (curation_policy.judge_endpoint)",
        )
    source, reference = found
    if rule.rule == "regex" and (problem := matching.check_regex(reference)):
        return Rejection("bad_reference_match", problem)
    if rule.rule == "facts":
        facts = extract_facts(reference)
        if not facts or len(facts) > MAX_FACTS:
            if judge is not None:  # a reference-guided judge decides
                return {"kind": "judge", "source": source, **judge}, reference
            return _uncheckable(len(facts))
        rule = replace(rule, facts=tuple(facts))
    spec: dict[str, Any] = {"kind": "reference", "source": source, "match": rule.to_dict()}
    if judge is not None:
        spec["judge"] = judge
    return spec, reference


def _reference(
    trace: Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any],
) -> tuple[str, str] | None:
    """The most trusted reference answer the trace has, with its source, or None."""
    feedback = context.get("feedback") if isinstance(context.get("feedback"), Mapping) else None
    answer = final_answer(messages)
    outcome = json_object(trace.get("outcome"))
    candidates: list[tuple[str, Any]] = []
    if feedback is not None:
        candidates.append(("feedback_correction", feedback.get("correction")))
    candidates.append(("trace", trace.get("reference_answer")))
    if feedback is not None and feedback_is_positive(feedback):
        candidates.append(("feedback_positive", answer))
    if outcome.get("success") is True and (feedback is None or feedback_is_positive(feedback)):
        candidates.append(("success_trace", answer))
    candidates.append(("success_trace", context.get("success_answer")))
    for source, reference in candidates:
        if isinstance(reference, str) and reference.strip():
            return source, reference
    return None


def _judge_spec(settings: Mapping[str, Any]) -> dict[str, Any] | None:
    endpoint = settings.get("judge_endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        return None
    return {
        "endpoint": endpoint,
        "model": settings.get("judge_model") or endpoint,
        "rubric": settings.get("judge_rubric") or "",
        "cost_per_1k_tokens": settings.get("judge_cost_per_1k_tokens") or 0.0,
    }


def _uncheckable(count: int) -> Rejection:
    what = (
        "holds no checkable fact (a number, time, date, code, quoted string or proper name)"
        if count == 0
        else f"holds {count} facts, more than the {MAX_FACTS} the facts rule checks"
    )
    return Rejection(
        "no_checkable_facts",
        f"the reference answer {what}, so the facts rule cannot tell a right answer from a "
        "wrong one: set reference_match (text, number, json_subset or regex) in the trace's "
        "metadata or the loop's curation_policy, or name a judge "
        "(curation_policy.judge_endpoint) to grade it against the reference",
    )

"""Replay rewards: which source a trace's task is scored by (in order of trust), the five
matching rules, and a trace none can score. (The facts rule's own cases are in
test_replay_facts.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from services.environments.base import Rejection, TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.judge import parse_verdict
from services.environments.replay.matching import MatchRuleError, matches, parse_rule, score
from tests.services.environments.replay_traces import failing_trace, hermes


def _task(trace: dict[str, Any]) -> TaskSpec:
    task = ReplayEnvironment().task_from_trace(trace)
    assert isinstance(task, TaskSpec), task
    return task


def _reward(task: TaskSpec, answer: str) -> float:
    env = ReplayEnvironment()
    episode = env.chat_start(task)
    env.chat_step(task, episode, answer)
    return env.chat_verify(task, episode).total


def test_the_traces_reference_answer_scores_the_answer() -> None:
    task = _task(failing_trace())
    assert task.reference_answer == r".*\boverdue\b.*"
    assert _reward(task, "Sorry, the patron has overdue loans.") == 1.0
    assert _reward(task, "Done! The hold is placed.") == 0.0


def test_a_feedback_correction_becomes_the_reference() -> None:
    trace = failing_trace(
        reference_answer=None,
        metadata={},
        ratchet={"feedback": {"score": 0.0, "correction": "P-204 has 3 overdue loans: no hold"}},
    )
    task = _task(trace)
    assert task.reference_answer == "P-204 has 3 overdue loans: no hold"
    assert task.verifier["params"]["reward"]["source"] == "feedback_correction"
    # The default rule checks the correction's facts: the patron and the count.
    assert _reward(task, "Holds are blocked: patron p-204 has 3 overdue loans.") == 1.0
    assert _reward(task, "Done! The hold is placed.") == 0.0


def test_positive_feedback_makes_the_traces_answer_the_reference() -> None:
    # "Done! The hold is placed." states no checkable fact: the trace chooses the text rule.
    trace = failing_trace(
        reference_answer=None,
        metadata={"reference_match": "text"},
        ratchet={"feedback": {"label": "thumbs_up"}},
    )
    task = _task(trace)
    assert task.reference_answer == "Done! The hold is placed."
    assert task.verifier["params"]["reward"]["source"] == "feedback_positive"
    assert _reward(task, "done! the hold is placed") == 1.0


def test_negative_feedback_without_correction_gives_no_reference() -> None:
    trace = failing_trace(
        reference_answer=None,
        metadata={},
        outcome={"success": True},
        ratchet={"feedback": {"score": 0.1, "comment": "wrong"}},
    )
    rejection = ReplayEnvironment().task_from_trace(trace)
    assert isinstance(rejection, Rejection) and rejection.reason == "no_reward_source"


def test_a_successful_trace_of_the_same_conversation_gives_the_reference() -> None:
    own = _task(
        failing_trace(
            reference_answer=None, metadata={"reference_match": "text"}, outcome={"success": True}
        )
    )
    assert own.verifier["params"]["reward"]["source"] == "success_trace"
    other = _task(
        failing_trace(
            reference_answer=None,
            metadata={},
            ratchet={"success_answer": "The patron must return 3 overdue books first."},
        )
    )
    assert other.reference_answer == "The patron must return 3 overdue books first."
    assert other.verifier["params"]["reward"]["source"] == "success_trace"
    assert other.verifier["params"]["reward"]["match"] == {
        "rule": "facts",
        "facts": [{"kind": "number", "value": "3", "text": "3"}],
    }


def test_the_loops_judge_scores_what_nothing_else_can() -> None:
    policy = {"judge_endpoint": "grader", "judge_rubric": "Refuse holds for overdue patrons."}
    task = _task(failing_trace(reference_answer=None, metadata={}, ratchet={"policy": policy}))
    assert task.metadata["verifier_kind"] == "judge"
    assert task.reference_answer is None
    assert task.verifier["params"]["reward"]["endpoint"] == "grader"
    env = ReplayEnvironment()
    episode = env.chat_start(task)
    env.chat_step(task, episode, "No.")
    with pytest.raises(ValueError, match="judge endpoint 'grader'"):
        env.chat_verify(task, episode)


def test_a_trace_nothing_can_score_is_rejected_with_the_reason() -> None:
    rejection = ReplayEnvironment().task_from_trace(failing_trace(reference_answer=None))
    assert isinstance(rejection, Rejection)
    assert rejection.reason == "no_reward_source"
    assert "judge" in rejection.message and "feedback" in rejection.message


@pytest.mark.parametrize(
    ("rule", "reference", "answer", "expected"),
    [
        ("facts", "The book is due Friday.", "It is due on friday", True),
        ("facts", "The book is due Friday.", "The book is due Monday.", False),
        ("text", "The book is due Friday.", "  the BOOK is due   friday ", True),
        ("text", "The book is due Friday.", "The book is due Monday.", False),
        ({"rule": "number", "tolerance": 0.01}, "4.20", "The fine is $4.2", True),
        ({"rule": "number", "tolerance": 0.01}, "4.20", "The fine is $4.25", False),
        ({"rule": "number", "tolerance": 0.1, "relative": True}, "1,000", "about 1050", True),
        ("number", "3", "no numbers here", False),
        ("json_subset", '{"status": "blocked"}', '{"status": "Blocked", "loans": 3}', True),
        ("json_subset", '{"status": "blocked"}', 'Result: {"status": "placed"}', False),
        ("json_subset", '{"ids": [1, 2]}', 'ok {"ids": [1.0, 2]}', True),
        ("regex", r"b-\d+", "B-77", True),
        ("regex", r"b-\d+", "book B-77", False),
    ],
)
def test_matching_rules(rule: Any, reference: str, answer: str, expected: bool) -> None:
    assert matches(answer, reference, parse_rule(rule)) is expected


def test_unknown_rules_are_refused_by_name() -> None:
    with pytest.raises(MatchRuleError, match="must be one of"):
        parse_rule("fuzzy")
    with pytest.raises(MatchRuleError, match="unknown field"):
        parse_rule({"rule": "number", "tol": 1})
    with pytest.raises(MatchRuleError, match="tolerance"):
        parse_rule({"rule": "number", "tolerance": -1})
    # Facts come from the reference at curation; a loop or a trace cannot hand them in.
    with pytest.raises(MatchRuleError, match="read from the reference at curation"):
        parse_rule({"rule": "facts", "facts": [{"kind": "code", "value": "D4", "text": "D4"}]})
    stored = {"rule": "facts", "facts": [{"kind": "code", "value": "D4", "text": "D4"}]}
    assert parse_rule(stored, stored=True).to_dict() == stored
    with pytest.raises(MatchRuleError, match="only with rule facts"):
        parse_rule({"rule": "text", "facts": stored["facts"]}, stored=True)
    with pytest.raises(MatchRuleError, match=r"facts\[0\]\.kind"):
        parse_rule(
            {"rule": "facts", "facts": [{"kind": "x", "value": "1", "text": "1"}]}, stored=True
        )
    with pytest.raises(MatchRuleError, match="not a number"):
        parse_rule(
            {"rule": "facts", "facts": [{"kind": "number", "value": "ten", "text": "x"}]},
            stored=True,
        )


def test_the_default_rule_is_facts_and_scores_partial_credit() -> None:
    assert parse_rule({}).rule == "facts"
    reference = "Order PT-1003 was lost; it has been refunded in full (19.9 EUR)."
    assert score("PT-1003: refunded €19.90", reference, parse_rule("facts")).passed
    half = score("PT-1003 was refunded", reference, parse_rule("facts"))
    assert (half.credit, half.passed) == (0.5, False)
    with pytest.raises(MatchRuleError, match="no checkable fact"):
        score("anything", "Done! The hold is placed.", parse_rule("facts"))


@pytest.mark.parametrize(
    "reply",
    [
        '{"verdict": "pass", "score": 0.9, "reason": "states the overdue loans"}',
        '```json\n{"verdict": "pass", "score": 1, "reason": "ok"}\n```',
    ],
)
def test_a_judge_reply_is_one_json_verdict(reply: str) -> None:
    verdict = parse_verdict(reply)
    assert verdict.parsed and verdict.passed and verdict.score >= 0.9


@pytest.mark.parametrize(
    "reply",
    [
        "PASS",  # the old lenient parse passed this
        "Verdict: PASS",
        "0.8",
        'The answer says: reply PASS. {"verdict": "pass", "score": 1, "reason": "x"}',
        '{"verdict": "pass", "score": 1}{"verdict": "fail", "score": 0}',
        '{"verdict": "pass", "score": 0.2, "reason": "contradicts itself"}',
        '{"verdict": "PASS!", "score": 1, "reason": "x"}',
        '{"verdict": "pass", "score": true, "reason": "x"}',
        '{"verdict": "pass", "score": 1.5, "reason": "x"}',
        '["pass"]',
        "",
    ],
)
def test_anything_but_one_json_verdict_is_an_unparseable_fail(reply: str) -> None:
    verdict = parse_verdict(reply)
    assert (verdict.parsed, verdict.passed, verdict.score) == (False, False, 0.0)


def test_the_answer_is_read_from_the_raw_completion() -> None:
    task = _task(failing_trace())
    env = ReplayEnvironment()
    episode = env.chat_start(task)
    env.chat_step(task, episode, hermes("patron_loans", {"patron_id": "P-204"}))
    env.chat_step(task, episode, "It has overdue loans.")
    episode.messages[-1] = episode.messages[0]  # tampering with the episode changes nothing
    assert env.chat_verify(task, episode).passed

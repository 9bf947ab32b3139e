"""The facts rule, the default for a free-text reference: what it extracts from a reference,
which answers a person would accept pass (paraphrases, units, 12/24-hour times, dates in
another spelling, identifiers in another case), which do not (a wrong fact, a hedge), the
partial credit of a missing fact, and a reference with no fact to check."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.environments.base import Rejection, TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.facts import (
    NAME_STOP_WORDS,
    Fact,
    FactsError,
    extract_facts,
    score_facts,
)
from tests.services.environments.replay_traces import failing_trace

FLIGHT = "Your connection LX318 leaves 14:05 from gate D4; it is a 11 minute walk."


def _facts(text: str) -> list[tuple[str, str]]:
    return [(fact.kind, fact.value) for fact in extract_facts(text)]


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        (
            FLIGHT,
            [("code", "LX318"), ("time", "14:05"), ("code", "D4"), ("number", "11 minute")],
        ),
        (
            "Order PT-1003 was lost; it has been refunded in full (€19.90).",
            [("code", "PT1003"), ("number", "19.9 EUR")],
        ),
        (
            "Your flight leaves Friday, 4 December 2026 at 2:05 pm from Zurich Airport.",
            [("date", "2026-12-04"), ("time", "14:05"), ("name", "zurich airport")],
        ),
        (
            "Meet Anna Schmidt at Gate B12 on Dec 4. Thanks John!",
            # "Gate" labels the code; "Meet" starts the sentence; "Thanks" is a stop word.
            [("name", "anna schmidt"), ("code", "B12"), ("date", "--12-04"), ("name", "john")],
        ),
        (
            "Put a hold on 'The Left Hand of Darkness' for TR-88: 15% off, 3 km away.",
            [
                ("quote", "the left hand of darkness"),
                ("code", "TR88"),
                ("number", "15 %"),
                ("number", "3 km"),
            ],
        ),
        (
            "It lands 2026-12-04T09:30, a twenty-five minute taxi ride; fare $1,234.50.",
            [
                ("date", "2026-12-04"),
                ("time", "09:30"),
                ("number", "25 minute"),
                ("number", "1234.5 USD"),
            ],
        ),
        ("The patron must return 3 overdue books first.", [("number", "3")]),
        ("Done! The hold is placed.", []),
        ("Please note: Your parcel is on its way.", []),
        ("I will check that for you.", []),
    ],
)
def test_facts_are_extracted_from_a_reference(
    reference: str, expected: list[tuple[str, str]]
) -> None:
    assert _facts(reference) == expected


@pytest.mark.parametrize(
    ("reference", "answer"),
    [
        # Paraphrases.
        (FLIGHT, "LX318 departs at 14:05 from D4, an 11-minute walk"),
        (FLIGHT, "Flight lx 318 leaves at 2:05 PM from gate d4; eleven minutes on foot."),
        (FLIGHT, "Gate D4 (about 11 minutes away): LX-318 boards for a 14:05 departure."),
        # Units and money.
        ("It is 3 km away.", "about 3 kilometres"),
        ("Save 15%.", "You save 15 percent"),
        ("Refunded €19.90.", "We refunded 19.9 EUR"),
        ("Refunded 19.9 EUR.", "Refund: 19,90 €"),
        ("The total is 1,234 points.", "1234 points in total"),
        ("A 11-minute walk.", "11 minutes on foot"),
        # Times in 12 and 24 hours.
        ("Boarding at 14:05.", "boarding 2:05 pm"),
        ("Boarding at 2:05 PM.", "boarding at 14:05"),
        ("Doors open at 2 p.m.", "doors: 14:00"),
        ("The train leaves 00:30.", "it leaves at 12:30 am"),
        # Dates in other spellings (a year left out still states the date).
        ("Delivery on 2026-12-04.", "It arrives 4 December 2026"),
        ("Delivery on 4 December 2026.", "arrives December 4th, 2026"),
        ("Delivery on 2026-12-04.", "arrives on Dec 4"),
        ("Delivery on Friday, 4 Dec 2026.", "arrives 2026/12/04"),
        # Identifiers in another case or spelling; quotes and names without their marks.
        ("Order PT-1002 shipped.", "pt 1002 is on its way"),
        ("Order PT-1002 shipped.", "PT1002 shipped"),
        ("Reserve 'The Left Hand of Darkness'.", "I reserved The left hand of darkness."),
        ("Pick it up at Elm Street.", "pick-up: elm street"),
        # More facts than the reference, of kinds it does not hold: not a hedge.
        ("LX318 leaves from D4.", "LX318 leaves at 14:05 from D4, 11 minutes away"),
    ],
)
def test_answers_a_person_would_accept_pass(reference: str, answer: str) -> None:
    found = score_facts(answer, extract_facts(reference))
    assert (found.passed, found.fraction, found.missing) == (True, 1.0, ())


@pytest.mark.parametrize(
    ("reference", "answer", "fraction", "hedged"),
    [
        # A wrong fact.
        (FLIGHT, "LX318 leaves 14:15 from D4, an 11-minute walk", 0.75, ()),
        (FLIGHT, "LX318 leaves 14:05 from D5, an 11-minute walk", 0.75, ()),
        ("Refunded €19.90.", "We refunded 19.99 EUR", 0.0, ()),
        ("Refunded €19.90.", "We refunded $19.90", 0.0, ()),  # another currency
        ("It is 3 km away.", "It is 3 miles away", 0.0, ()),
        ("Boarding at 14:05.", "boarding 2:05", 0.0, ()),  # 2:05 is not 14:05
        ("Delivery on 2026-12-04.", "arrives 5 December 2026", 0.0, ()),
        # A missing fact: partial credit below the pass.
        (FLIGHT, "LX318 leaves 14:05 from D4.", 0.75, ()),
        (FLIGHT, "Your flight is LX318.", 0.25, ()),
        (FLIGHT, "I do not know.", 0.0, ()),
        # Hedging: more values of a kind than the reference holds.
        (FLIGHT, "LX318 leaves 14:05 or 15:10 from D4, an 11-minute walk", 0.75, ("time",)),
        (FLIGHT, "LX318 leaves 14:05 from D4 or D6, an 11-minute walk", 0.5, ("code:A9",)),
        (FLIGHT, "LX318 at 14:05, D4, 11 minutes, maybe 12 minutes", 0.75, ("number:minute",)),
        # "11 or 12 minutes": the 11 has no unit, so the 11-minute fact is not stated.
        (FLIGHT, "LX318 at 14:05, D4, 11 or 12 minutes", 0.75, ()),
        ("Delivery on 2026-12-04.", "on 2026-12-04 or 2026-12-05", 0.0, ("date",)),
    ],
)
def test_wrong_missing_and_hedged_answers_do_not_pass(
    reference: str, answer: str, fraction: float, hedged: tuple[str, ...]
) -> None:
    found = score_facts(answer, extract_facts(reference))
    assert not found.passed
    assert (found.fraction, found.hedged) == (fraction, hedged)


def test_the_same_fact_twice_is_one_fact_and_no_hedge() -> None:
    assert _facts("Leaves 14:05 (2:05 pm).") == [("time", "14:05")]
    assert score_facts("14:05, that is 2:05 PM", extract_facts("Leaves 14:05.")).passed


def test_stop_words_are_few_and_documented() -> None:
    assert len(NAME_STOP_WORDS) <= 20
    assert _facts("Is it Friday? Yes, Friday.") == [("name", "friday")]


def test_stored_facts_are_checked_when_read() -> None:
    assert Fact.from_dict({"kind": "time", "value": "14:05", "text": "2:05 pm"}, where="f")
    for bad in (
        {"kind": "time", "value": "14:05"},
        {"kind": "colour", "value": "red", "text": "red"},
        {"kind": "date", "value": "2026-13-01", "text": "x"},
        {"kind": "number", "value": "", "text": "x"},
    ):
        with pytest.raises(FactsError):
            Fact.from_dict(bad, where="f")
    with pytest.raises(FactsError, match="at least one fact"):
        score_facts("anything", [])


def _trace(reference: str, **policy: Any) -> dict[str, Any]:
    return failing_trace(reference_answer=reference, metadata={}, ratchet={"policy": policy})


def test_a_task_stores_the_facts_it_checks() -> None:
    task = ReplayEnvironment().task_from_trace(_trace(FLIGHT))
    assert isinstance(task, TaskSpec)
    match = task.verifier["params"]["reward"]["match"]
    assert match["rule"] == "facts"
    assert [f["text"] for f in match["facts"]] == ["LX318", "14:05", "D4", "11 minute"]
    env = ReplayEnvironment()
    episode = env.chat_start(task)
    env.chat_step(task, episode, "LX318 leaves 14:05 from D4.")
    reward = env.chat_verify(task, episode)
    assert (reward.total, reward.passed, reward.components) == (0.75, False, {"answer": 0.75})


@pytest.mark.parametrize("reference", ["Done! The hold is placed.", "Sure, I can help you."])
def test_a_reference_with_no_fact_is_rejected_or_judged(reference: str) -> None:
    rejection = ReplayEnvironment().task_from_trace(_trace(reference))
    assert isinstance(rejection, Rejection) and rejection.reason == "no_checkable_facts"
    assert "reference_match" in rejection.message and "judge" in rejection.message
    judged = ReplayEnvironment().task_from_trace(
        _trace(reference, judge_endpoint="grader", judge_rubric="Holds must be refused.")
    )
    assert isinstance(judged, TaskSpec) and judged.metadata["verifier_kind"] == "judge"
    assert judged.reference_answer == reference
    # A trace may choose another rule for such a reference, as before.
    text = failing_trace(reference_answer=reference, metadata={"reference_match": "text"})
    assert isinstance(ReplayEnvironment().task_from_trace(text), TaskSpec)


_PIECES = (
    "LX318",
    "d4",
    "PT-1002",
    "ZRH",
    "14:05",
    "2:05 pm",
    "12 am",
    "2026-12-04",
    "4 December",
    "Dec 4th, 2026",
    "Friday",
    "€19.90",
    "19,90 €",
    "11-minute",
    "eleven minutes",
    "3 km",
    "15%",
    "1,234",
    "'Dune'",
    '"The Left Hand"',
    "Elm Street",
    "Anna",
    "I",
    "Please",
    "or",
    "the",
    "walk",
    "gate",
    ".",
    ",",
    ";",
    ":",
    "!",
    "?",
    "\n",
    "(",
    ")",
    "-",
    "é",
    "٣",
    "\u2019",
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30), st.sampled_from((" ", "", "  ")))
def test_every_reference_passes_its_own_check(pieces: list[str], glue: str) -> None:
    reference = glue.join(pieces)
    facts = extract_facts(reference)
    if facts:
        found = score_facts(reference, facts)
        assert found.passed, (reference, found)
    for fact in facts:  # what is stored reads back
        assert Fact.from_dict(fact.to_dict(), where="f") == fact

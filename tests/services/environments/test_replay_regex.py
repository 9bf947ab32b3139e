"""A trace's regex reference cannot hang the jobs that score its task (ReDoS): the pattern
runs on RE2, linear in the answer; what RE2 cannot run (a backreference, a lookaround) or a
pattern too long is refused at curation with the reason; an answer over the cap passes no
rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.environments.base import Rejection, TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.matching import (
    MAX_ANSWER_CHARS,
    MAX_PATTERN_CHARS,
    matches,
    parse_rule,
)
from tests.services.environments.replay_traces import failing_trace

ROOT = Path(__file__).resolve().parents[3]
# Exponential on a backtracking engine: Python's re took 2.3 s on a 25-character answer and
# four times as long for every two characters more (measured on main before this fix).
HOSTILE = "(.|.)*!"


def _regex_trace(pattern: str) -> dict[str, object]:
    return failing_trace(reference_answer=pattern, metadata={"reference_match": "regex"})


@pytest.mark.slow
def test_a_hostile_pattern_on_a_long_answer_returns() -> None:
    """The guard is the subprocess's timeout (generous): on the old engine this call would
    not end in the age of the universe."""
    script = (
        "from services.environments.replay.matching import matches, parse_rule\n"
        f"print(matches('a' * 10_000, {HOSTILE!r}, parse_rule('regex')),"
        " matches('a' * 10_000 + 'b', '(a|a)*b', parse_rule('regex')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.split() == ["False", "True"]


def test_the_hostile_pattern_is_a_task_whose_check_is_linear() -> None:
    task = ReplayEnvironment().task_from_trace(_regex_trace(HOSTILE))
    assert isinstance(task, TaskSpec)  # RE2 takes it: it is no longer dangerous


@pytest.mark.parametrize(
    ("pattern", "said"),
    [
        (r"(blocked)\s+\1", "backreferences and lookarounds are not supported"),
        (r"(?=.*overdue).*", "backreferences and lookarounds are not supported"),
        ("(unclosed", "not a valid regular expression"),
        ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS} are checked"),
    ],
)
def test_what_re2_cannot_run_is_refused_at_curation(pattern: str, said: str) -> None:
    rejection = ReplayEnvironment().task_from_trace(_regex_trace(pattern))
    assert isinstance(rejection, Rejection) and rejection.reason == "bad_reference_match"
    assert said in rejection.message


def test_regex_references_keep_their_meaning() -> None:
    rule = parse_rule("regex")
    assert matches("Sorry, the patron has OVERDUE loans.", r".*\boverdue\b.*", rule)
    assert not matches("book B-77", r"b-\d+", rule)  # the whole answer must match
    assert not matches("anything", r"(a)\1", rule)  # a stored pattern RE2 refuses never passes


def test_an_answer_over_the_cap_passes_no_rule() -> None:
    long = "x" * (MAX_ANSWER_CHARS + 1)
    for rule, reference in (("regex", ".*"), ("text", long), ("facts", "Gate D4")):
        assert not matches(long + " D4", reference, parse_rule(rule))

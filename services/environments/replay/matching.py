"""How an answer is checked against a reference: the five stated matching rules.

- ``facts`` (the default): every checkable fact of the reference (numbers with units, times,
  dates, codes, quoted strings, proper names; extracted once at curation and stored in the
  rule as ``facts``) is stated in the answer, normalized; the reward is the fraction stated,
  and an answer that hedges (more values of a kind than the reference has) does not pass
  (:mod:`.facts`);
- ``text``: equal after normalizing (Unicode NFKC, case-folded, whitespace collapsed,
  trailing sentence punctuation and surrounding quotes dropped): "The book is due Friday."
  matches "the book is due friday";
- ``number``: the answer's last number equals the reference's within ``tolerance``
  (absolute, or relative to the reference when ``relative`` is true); thousands separators
  are read ("1,234.5" is 1234.5);
- ``json_subset``: the answer holds a JSON value (the whole text, or the first object or
  array in it) that contains the reference: every key of a reference object is in the
  answer with a matching value (recursively), arrays match element by element, scalars by
  equality (numbers with ``tolerance``);
- ``regex``: the reference is a regular expression the whole normalized answer must match
  (full match, case-insensitive), run by RE2 (``google-re2``), whose time is linear in the
  answer: a trace chooses the pattern, and a backtracking engine lets one pattern such as
  ``(.|.)*!`` stall every job that scores its task. A pattern RE2 cannot take (a
  backreference, a lookaround) or longer than :data:`MAX_PATTERN_CHARS` is refused at
  curation with the reason.

A rule is a small object, ``{"rule": "number", "tolerance": 0.01}``, stored in the task's
verifier so the check travels with the task; :func:`parse_rule` refuses unknown rules and
fields with a message naming them. An answer longer than :data:`MAX_ANSWER_CHARS` passes no
rule (no agent's final answer is that long, and every check stays bounded).
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import re2

from services.environments.replay.facts import Fact, FactsError, extract_facts, score_facts

RuleName = Literal["facts", "text", "number", "json_subset", "regex"]
RULES: tuple[RuleName, ...] = ("facts", "text", "number", "json_subset", "regex")
DEFAULT_RULE: RuleName = "facts"
MAX_PATTERN_CHARS = 1_000
MAX_ANSWER_CHARS = 20_000

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_DECODER = json.JSONDecoder()


class MatchRuleError(ValueError):
    """A matching rule that is not one of the five, or has fields it does not take."""


@dataclass(frozen=True)
class MatchRule:
    """One of the five rules and its parameters; ``facts`` are the reference's, filled in
    at curation (a loop's or a trace's rule names only the rule)."""

    rule: RuleName = DEFAULT_RULE
    tolerance: float = 1e-6
    relative: bool = False
    facts: tuple[Fact, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule}
        if self.rule in ("number", "json_subset"):
            out["tolerance"] = self.tolerance
            out["relative"] = self.relative
        if self.facts:
            out["facts"] = [fact.to_dict() for fact in self.facts]
        return out


@dataclass(frozen=True)
class MatchScore:
    """An answer's score under a rule: the credit (the fraction of facts stated, else 0 or
    1) and whether it passed."""

    credit: float
    passed: bool


def parse_rule(raw: Any, *, where: str = "reference_match", stored: bool = False) -> MatchRule:
    """A rule from ``"number"`` or ``{"rule": "number", "tolerance": 0.5}``; ``stored``: a
    task's own rule, which may carry the facts curation extracted."""
    if isinstance(raw, str):
        raw = {"rule": raw}
    if not isinstance(raw, Mapping):
        raise MatchRuleError(f"{where} must be a rule name or an object with 'rule'")
    unknown = sorted(
        set(raw) - {"rule", "tolerance", "relative"} - ({"facts"} if stored else set())
    )
    if unknown:
        hint = " (facts are read from the reference at curation)" if "facts" in unknown else ""
        raise MatchRuleError(f"{where} has unknown field(s) {unknown}{hint}")
    rule = raw.get("rule", DEFAULT_RULE)
    if rule not in RULES:
        raise MatchRuleError(f"{where}.rule must be one of {list(RULES)}, got {rule!r}")
    tolerance = raw.get("tolerance", 1e-6)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or tolerance < 0:
        raise MatchRuleError(f"{where}.tolerance must be a number >= 0, got {tolerance!r}")
    relative = raw.get("relative", False)
    if not isinstance(relative, bool):
        raise MatchRuleError(f"{where}.relative must be true or false")
    facts = _stored_facts(raw.get("facts"), rule, where=f"{where}.facts")
    return MatchRule(rule=rule, tolerance=float(tolerance), relative=relative, facts=facts)


def _stored_facts(raw: Any, rule: str, *, where: str) -> tuple[Fact, ...]:
    if raw is None:
        return ()
    if rule != "facts" or not isinstance(raw, list) or not raw:
        raise MatchRuleError(f"{where} must be a non-empty list, and only with rule facts")
    try:
        return tuple(Fact.from_dict(item, where=f"{where}[{i}]") for i, item in enumerate(raw))
    except FactsError as exc:
        raise MatchRuleError(str(exc)) from None


def check_regex(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a regex reference, or None."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return (
            f"the regex reference is {len(pattern)} characters long; at most "
            f"{MAX_PATTERN_CHARS} are checked"
        )
    try:
        re.compile(pattern)  # only to tell a syntax error from what RE2 refuses
    except re.error as exc:
        return f"the reference is not a valid regular expression: {exc}"
    try:
        _compiled(pattern)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        return (
            f"the regex reference cannot be run by RE2, the linear-time engine regex "
            f"references use ({reason}): backreferences and lookarounds are not supported"
        )
    return None


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> Any:
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    return re2.compile(pattern, options)


def normalize_text(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    text = " ".join(text.split())
    text = text.strip().strip("\"'`")
    return text.rstrip(".!?;:").strip()


def score(answer: str | None, reference: str, rule: MatchRule) -> MatchScore:
    """How well ``answer`` satisfies ``reference`` under ``rule``."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return MatchScore(0.0, False)
    if rule.rule == "facts":
        facts = rule.facts or tuple(extract_facts(reference))
        if not facts:
            raise MatchRuleError("the reference holds no checkable fact for the facts rule")
        found = score_facts(answer, facts)
        return MatchScore(found.fraction, found.passed)
    passed = matches(answer, reference, rule)
    return MatchScore(1.0 if passed else 0.0, passed)


def matches(answer: str | None, reference: str, rule: MatchRule) -> bool:
    """Whether ``answer`` satisfies ``reference`` under ``rule``."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    if rule.rule == "facts":
        return score(answer, reference, rule).passed
    if rule.rule == "text":
        return normalize_text(answer) == normalize_text(reference)
    if rule.rule == "number":
        got, want = last_number(answer), last_number(reference)
        return got is not None and want is not None and _close(got, want, rule)
    if rule.rule == "regex":
        if check_regex(reference) is not None:
            return False  # a task curated before RE2 with a pattern it cannot take
        return _compiled(reference).fullmatch(normalize_text(answer)) is not None
    want_json = first_json(reference)
    got_json = first_json(answer)
    if want_json is _MISSING or got_json is _MISSING:
        return False
    return _contains(got_json, want_json, rule)


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


_MISSING: Any = object()


def first_json(text: str) -> Any:
    """The JSON value of ``text`` (whole), else its first object or array; else _MISSING."""
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except ValueError:
        pass
    for index, char in enumerate(stripped):
        if char in "{[":
            try:
                return _DECODER.raw_decode(stripped, index)[0]
            except ValueError:
                continue
    return _MISSING


def _close(got: float, want: float, rule: MatchRule) -> bool:
    if not (math.isfinite(got) and math.isfinite(want)):
        return got == want
    bound = rule.tolerance * abs(want) if rule.relative else rule.tolerance
    return abs(got - want) <= bound


def _contains(got: Any, want: Any, rule: MatchRule) -> bool:
    if isinstance(want, Mapping):
        return isinstance(got, Mapping) and all(
            key in got and _contains(got[key], value, rule) for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_contains(g, w, rule) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, int | float) and isinstance(got, int | float):
        return _close(float(got), float(want), rule)
    if isinstance(want, str) and isinstance(got, str):
        return normalize_text(got) == normalize_text(want)
    return bool(got == want)

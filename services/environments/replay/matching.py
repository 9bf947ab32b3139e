"""How an answer is checked against a reference: the four stated matching rules.

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
  (``re.fullmatch``, case-insensitive).

A rule is a small object, ``{"rule": "number", "tolerance": 0.01}``, stored in the task's
verifier so the check travels with the task; :func:`parse_rule` refuses unknown rules and
fields with a message naming them.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

RuleName = Literal["text", "number", "json_subset", "regex"]
RULES: tuple[RuleName, ...] = ("text", "number", "json_subset", "regex")

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_DECODER = json.JSONDecoder()


class MatchRuleError(ValueError):
    """A matching rule that is not one of the four, or has fields it does not take."""


@dataclass(frozen=True)
class MatchRule:
    """One of the four rules and its parameters."""

    rule: RuleName = "text"
    tolerance: float = 1e-6
    relative: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule}
        if self.rule in ("number", "json_subset"):
            out["tolerance"] = self.tolerance
            out["relative"] = self.relative
        return out


def parse_rule(raw: Any, *, where: str = "reference_match") -> MatchRule:
    """A rule from ``"number"`` or ``{"rule": "number", "tolerance": 0.5}``."""
    if isinstance(raw, str):
        raw = {"rule": raw}
    if not isinstance(raw, Mapping):
        raise MatchRuleError(f"{where} must be a rule name or an object with 'rule'")
    unknown = sorted(set(raw) - {"rule", "tolerance", "relative"})
    if unknown:
        raise MatchRuleError(f"{where} has unknown field(s) {unknown}")
    rule = raw.get("rule", "text")
    if rule not in RULES:
        raise MatchRuleError(f"{where}.rule must be one of {list(RULES)}, got {rule!r}")
    tolerance = raw.get("tolerance", 1e-6)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or tolerance < 0:
        raise MatchRuleError(f"{where}.tolerance must be a number >= 0, got {tolerance!r}")
    relative = raw.get("relative", False)
    if not isinstance(relative, bool):
        raise MatchRuleError(f"{where}.relative must be true or false")
    return MatchRule(rule=rule, tolerance=float(tolerance), relative=relative)


def check_regex(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a regex reference, or None."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"the reference is not a valid regular expression: {exc}"
    return None


def normalize_text(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    text = " ".join(text.split())
    text = text.strip().strip("\"'`")
    return text.rstrip(".!?;:").strip()


def matches(answer: str | None, reference: str, rule: MatchRule) -> bool:
    """Whether ``answer`` satisfies ``reference`` under ``rule``."""
    if answer is None:
        return False
    if rule.rule == "text":
        return normalize_text(answer) == normalize_text(reference)
    if rule.rule == "number":
        got, want = last_number(answer), last_number(reference)
        return got is not None and want is not None and _close(got, want, rule)
    if rule.rule == "regex":
        try:
            return re.fullmatch(reference, normalize_text(answer), re.IGNORECASE) is not None
        except re.error:
            return False
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

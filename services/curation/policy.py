"""A loop's curation policy: the keys of ``loops.curation_policy``, their defaults and checks.

Unknown keys are refused (a typo must never silently become a default) and every error names
the key and the accepted range, so ``ratchet loop create`` or the admin API can print it as is.
docs/curation.md lists the same keys with their meaning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_PATTERN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class CurationPolicyError(ValueError):
    """``loops.curation_policy`` holds a key or value curation cannot use."""


@dataclass(frozen=True)
class CustomPattern:
    """A per-loop redaction rule: matches of ``pattern`` become ``[REDACTED_<NAME>]``."""

    name: str
    pattern: str


@dataclass(frozen=True)
class CurationPolicy:
    """How a loop turns traces into tasks. Every field is a key of ``loops.curation_policy``."""

    # Selection.
    success_sample_rate: float = 0.05
    failure_score_threshold: float | None = 0.5
    max_trace_bytes: int = 1_000_000
    # Redaction.
    redact_patterns: tuple[CustomPattern, ...] = ()
    redact_high_entropy: bool = True
    # Deduplication and clusters (Jaccard similarity of normalized prompt shingles).
    near_duplicate_threshold: float = 0.9
    cluster_threshold: float = 0.8
    # Splits.
    eval_fraction: float = 0.2
    heldout_fraction: float = 0.1
    heldout_max_tasks: int = 200
    # Difficulty: opt-in, since it costs a probe job per cycle (the loop runs the champion
    # ``probe_attempts`` times on each unprobed train task; the snapshot filters).
    difficulty_filter: bool = False
    probe_attempts: int = 8
    # Snapshots.
    max_train_tasks: int = 20_000
    max_eval_tasks: int = 2_000
    max_regression_tasks: int = 1_000
    # Drift: fewest traces of a model version before its failure rate counts.
    drift_min_traces: int = 20

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> CurationPolicy:
        """Parse ``loops.curation_policy``; raises :class:`CurationPolicyError` naming the key."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise CurationPolicyError("curation_policy must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CurationPolicyError(
                f"unknown curation_policy key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for key, value in raw.items():
            values[key] = _PARSERS[key](key, value)
        policy = cls(**values)
        policy._check_relations()
        return policy

    def to_json(self) -> dict[str, Any]:
        """The policy as it would be stored (all keys, defaults filled in)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "redact_patterns":
                value = [{"name": p.name, "pattern": p.pattern} for p in value]
            out[f.name] = value
        return out

    def _check_relations(self) -> None:
        if self.cluster_threshold > self.near_duplicate_threshold:
            raise CurationPolicyError(
                f"cluster_threshold ({self.cluster_threshold}) must not exceed "
                f"near_duplicate_threshold ({self.near_duplicate_threshold}): every near "
                "duplicate must also be in its kept task's cluster"
            )
        if self.eval_fraction + self.heldout_fraction >= 1.0:
            raise CurationPolicyError(
                f"eval_fraction + heldout_fraction ({self.eval_fraction} + "
                f"{self.heldout_fraction}) must be below 1 so some clusters are trained on"
            )


def _fraction(key: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CurationPolicyError(f"curation_policy.{key} must be a number, got {value!r}")
    number = float(value)
    if not low <= number <= high:
        raise CurationPolicyError(
            f"curation_policy.{key} must be between {low} and {high}, got {value!r}"
        )
    return number


def _threshold(key: str, value: Any) -> float:
    # Below 0.5 the persisted LSH bands (see services.curation.similarity) miss too many
    # pairs to honour the threshold, so lower values are refused rather than half-applied.
    return _fraction(key, value, low=0.5, high=1.0)


def _optional_fraction(key: str, value: Any) -> float | None:
    return None if value is None else _fraction(key, value)


def _count(key: str, value: Any, *, low: int = 0, high: int = 10_000_000) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CurationPolicyError(f"curation_policy.{key} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise CurationPolicyError(
            f"curation_policy.{key} must be between {low} and {high}, got {value!r}"
        )
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CurationPolicyError(f"curation_policy.{key} must be true or false, got {value!r}")
    return value


def _patterns(key: str, value: Any) -> tuple[CustomPattern, ...]:
    if not isinstance(value, list):
        raise CurationPolicyError(
            f"curation_policy.{key} must be a list of {{'name': ..., 'pattern': ...}} objects"
        )
    patterns: list[CustomPattern] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        where = f"curation_policy.{key}[{index}]"
        if not isinstance(item, Mapping) or set(item) != {"name", "pattern"}:
            raise CurationPolicyError(
                f"{where} must be an object with exactly 'name' and 'pattern'"
            )
        name, pattern = item["name"], item["pattern"]
        if not isinstance(name, str) or not _PATTERN_NAME.match(name):
            raise CurationPolicyError(
                f"{where}.name must match {_PATTERN_NAME.pattern} (it becomes a metric label), "
                f"got {name!r}"
            )
        if name in seen:
            raise CurationPolicyError(f"{where}.name {name!r} is used twice")
        if not isinstance(pattern, str) or not pattern:
            raise CurationPolicyError(f"{where}.pattern must be a non-empty regular expression")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise CurationPolicyError(f"{where}.pattern is not a valid regex: {exc}") from None
        if compiled.fullmatch(""):
            raise CurationPolicyError(f"{where}.pattern must not match the empty string")
        seen.add(name)
        patterns.append(CustomPattern(name=name, pattern=pattern))
    return tuple(patterns)


_PARSERS: dict[str, Any] = {
    "success_sample_rate": _fraction,
    "failure_score_threshold": _optional_fraction,
    "max_trace_bytes": lambda k, v: _count(k, v, low=1_024, high=1_000_000_000),
    "redact_patterns": _patterns,
    "redact_high_entropy": _flag,
    "near_duplicate_threshold": _threshold,
    "cluster_threshold": _threshold,
    "eval_fraction": lambda k, v: _fraction(k, v, high=0.9),
    "heldout_fraction": lambda k, v: _fraction(k, v, high=0.9),
    "heldout_max_tasks": _count,
    "difficulty_filter": _flag,
    "probe_attempts": lambda k, v: _count(k, v, low=2, high=256),
    "max_train_tasks": lambda k, v: _count(k, v, low=1),
    "max_eval_tasks": lambda k, v: _count(k, v, low=1),
    "max_regression_tasks": _count,
    "drift_min_traces": lambda k, v: _count(k, v, low=1),
}

"""A loop's curation policy: the keys of ``loops.curation_policy``, their defaults and checks.

Unknown keys are refused (a typo must never silently become a default) and every error names
the key and the accepted range, so ``ratchet loop create`` or the admin API can print it as is.
docs/curation.md lists the same keys with their meaning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from services.environments.replay.matching import MatchRule, MatchRuleError, parse_rule

_PATTERN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_ENDPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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
    # Successes on the trained side a dataset offers rft's replay (services.curation.splits).
    max_replay_tasks: int = 1_000
    # Drift: fewest traces of a model version before its failure rate counts.
    drift_min_traces: int = 20
    # Rewards of the replay environment (docs/curation.md, "Rewards"): the rule a reference
    # answer is checked by, and the judge for traces no reference or feedback can score; the
    # endpoints are names from the deployment's settings (judge_endpoints, tool_endpoints),
    # never URLs.
    reference_match: MatchRule = field(default_factory=MatchRule)
    judge_endpoint: str | None = None
    judge_model: str | None = None
    judge_rubric: str | None = None
    judge_cost_per_1k_tokens: float = 0.0
    tool_endpoint: str | None = None

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
            elif f.name == "reference_match":
                value = value.to_dict()
            out[f.name] = value
        return out

    def replay_settings(self) -> dict[str, Any]:
        """What the replay environment reads of the policy when it builds a task."""
        return {
            "reference_match": self.reference_match.to_dict(),
            "judge_endpoint": self.judge_endpoint,
            "judge_model": self.judge_model,
            "judge_rubric": self.judge_rubric,
            "judge_cost_per_1k_tokens": self.judge_cost_per_1k_tokens,
            "tool_endpoint": self.tool_endpoint,
        }

    def _check_relations(self) -> None:
        if self.judge_endpoint is not None and not self.judge_rubric:
            raise CurationPolicyError(
                "curation_policy.judge_rubric is required with judge_endpoint: the judge "
                "grades answers by it"
            )
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


def _endpoint_name(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _ENDPOINT_NAME.match(value):
        raise CurationPolicyError(
            f"curation_policy.{key} must be the name of an endpoint in the deployment's "
            f"settings (matching {_ENDPOINT_NAME.pattern}), got {value!r}"
        )
    return value


def _optional_text(key: str, value: Any, *, limit: int = 8_000) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise CurationPolicyError(
            f"curation_policy.{key} must be a non-empty string of at most {limit} characters"
        )
    return value


def _match_rule(key: str, value: Any) -> MatchRule:
    try:
        return parse_rule(value, where=f"curation_policy.{key}")
    except MatchRuleError as exc:
        raise CurationPolicyError(str(exc)) from None


def _price(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1e6:
        raise CurationPolicyError(f"curation_policy.{key} must be a number >= 0, got {value!r}")
    return float(value)


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
    "max_replay_tasks": _count,
    "drift_min_traces": lambda k, v: _count(k, v, low=1),
    "reference_match": _match_rule,
    "judge_endpoint": _endpoint_name,
    "judge_model": lambda k, v: _optional_text(k, v, limit=200),
    "judge_rubric": _optional_text,
    "judge_cost_per_1k_tokens": _price,
    "tool_endpoint": _endpoint_name,
}

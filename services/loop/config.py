"""A loop's configuration as one document: merge patches onto it, and the diff of two versions.

The document is what ``ratchet loop apply -f loop.yaml`` declares and what
``loop_config_versions`` stores: the environment, the executor, the budget and every policy as
the operator gave it (defaults are left out, so a loop keeps getting the code's defaults as
they improve). Changes arrive as JSON merge patches (RFC 7386): a key set to ``null``
returns that setting to its default. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The policies of a loop, each a JSON object, in the order people read them.
POLICY_KEYS: tuple[str, ...] = (
    "training_profile",
    "gate_policy",
    "trigger_policy",
    "curation_policy",
    "serving_target",
)
# Every key of the document; ``environment`` is fixed once the loop exists (its tasks are
# that environment's), the rest can change.
CONFIG_KEYS: tuple[str, ...] = ("environment", "executor", "budget_usd", *POLICY_KEYS)

_MISSING = object()


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return patch
    result: dict[str, Any] = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def replacement_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns ``current`` into ``desired`` exactly (what apply sends)."""
    patch: dict[str, Any] = {}
    for key in current:
        if key not in desired:
            patch[key] = None
    for key, value in desired.items():
        before = current.get(key, _MISSING)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = replacement_patch(before, value)
            if nested:
                patch[key] = nested
        elif before is _MISSING or before != value:
            patch[key] = value
    return patch


@dataclass(frozen=True)
class Change:
    """One setting that differs between two versions (``None`` on a side: not set there)."""

    path: str
    before: Any
    after: Any

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "before": self.before, "after": self.after}


def diff(before: Mapping[str, Any], after: Mapping[str, Any], prefix: str = "") -> list[Change]:
    """Every leaf that was added, removed or changed, by dotted path, sorted."""
    changes: list[Change] = []
    for key in sorted(set(before) | set(after)):
        path = f"{prefix}{key}"
        old, new = before.get(key), after.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changes.extend(diff(old, new, prefix=f"{path}."))
        elif isinstance(old, Mapping) and new is None:
            changes.extend(diff(old, {}, prefix=f"{path}."))
        elif old is None and isinstance(new, Mapping):
            changes.extend(diff({}, new, prefix=f"{path}."))
        elif old != new:
            changes.append(Change(path, old, new))
    return changes


def render_diff(changes: list[Change]) -> list[str]:
    """``- path: old`` / ``+ path: new`` lines, as a person reads a diff."""
    import json

    lines: list[str] = []
    for change in changes:
        if change.before is not None:
            lines.append(f"- {change.path}: {json.dumps(change.before, sort_keys=True)}")
        if change.after is not None:
            lines.append(f"+ {change.path}: {json.dumps(change.after, sort_keys=True)}")
    return lines

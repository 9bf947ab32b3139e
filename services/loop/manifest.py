"""The loop file of ``ratchet loop apply -f loop.yaml``: a loop declared as code.

```yaml
schema: ratchet.loop/v1        # optional
name: support-bot
environment: toolcalc
executor: local                # optional: kept as it is when absent
budget_usd: 50                 # optional: absent means no cap
training_profile: {algorithm: grpo, hyperparameters: {steps: 40}}
gate_policy: {confidence: 0.95}
trigger_policy: {min_new_tasks: 32}
curation_policy: {}
serving_target: {kind: local}
```

The file is the loop's whole configuration, as a Deployment manifest is a Deployment's:
a policy the file leaves out goes back to its defaults, so what is in git is what runs.
Applying computes the JSON merge patch from the loop as it is to the file, which the api
validates (422 per field) and records as a new version. Pure functions, no I/O but reading
the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.loop.config import CONFIG_KEYS, POLICY_KEYS, replacement_patch

LOOP_SCHEMA = "ratchet.loop/v1"
_FILE_KEYS = frozenset({"schema", "name", *CONFIG_KEYS})


class LoopFileError(ValueError):
    """The loop file cannot be read or does not declare a loop."""


@dataclass(frozen=True)
class LoopManifest:
    """A loop as a file declares it: its name and the configuration keys the file sets."""

    name: str
    environment: str
    settings: dict[str, Any]

    def create_arguments(self) -> dict[str, Any]:
        """The settings this file sets, as ``RatchetClient.create_loop`` takes them (its
        keyword arguments and the documents of its ``LoopPolicies``)."""
        return {key: value for key, value in self.settings.items() if value is not None}

    def desired(self, current: Mapping[str, Any]) -> dict[str, Any]:
        """The configuration document the loop should have, given the one it has."""
        document: dict[str, Any] = {
            "environment": self.environment,
            "executor": self.settings.get("executor") or current.get("executor"),
            "budget_usd": self.settings.get("budget_usd"),
        }
        for key in POLICY_KEYS:
            document[key] = dict(self.settings.get(key) or {})
        return document

    def patch_for(self, current: Mapping[str, Any]) -> dict[str, Any]:
        """The ``PATCH /v1/loops/{name}`` body that turns ``current`` into this file."""
        desired = self.desired(current)
        patch: dict[str, Any] = {"environment": self.environment}
        if desired["executor"] != current.get("executor"):
            patch["executor"] = desired["executor"]
        if desired["budget_usd"] != current.get("budget_usd"):
            patch["budget_usd"] = desired["budget_usd"]
        for key in POLICY_KEYS:
            before = dict(current.get(key) or {})
            if desired[key] == before:
                continue
            patch[key] = replacement_patch(before, desired[key]) if desired[key] else None
        return patch


def parse_loop_document(data: Any, *, source: str = "the loop file") -> LoopManifest:
    """Check the document's shape (the api checks the values) and build the manifest."""
    if not isinstance(data, Mapping):
        raise LoopFileError(f"{source} must be a mapping of settings (name, environment, ...)")
    unknown = sorted(str(key) for key in data if key not in _FILE_KEYS)
    if unknown:
        raise LoopFileError(
            f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_FILE_KEYS))}"
        )
    schema = data.get("schema", LOOP_SCHEMA)
    if schema != LOOP_SCHEMA:
        raise LoopFileError(f"{source}: schema must be {LOOP_SCHEMA!r}, got {schema!r}")
    for key in ("name", "environment"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise LoopFileError(f"{source}: {key!r} is required (a string)")
    for key in POLICY_KEYS:
        value = data.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise LoopFileError(f"{source}: {key!r} must be a mapping")
    budget = data.get("budget_usd")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)):
        raise LoopFileError(f"{source}: 'budget_usd' must be a number of dollars")
    executor = data.get("executor")
    if executor is not None and not isinstance(executor, str):
        raise LoopFileError(f"{source}: 'executor' must be a string")
    settings = {key: data[key] for key in CONFIG_KEYS if key in data and key != "environment"}
    return LoopManifest(name=data["name"], environment=data["environment"], settings=settings)


def read_loop_file(path: Path | str) -> LoopManifest:
    """Read and check a loop file; every problem is one :class:`LoopFileError` line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LoopFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LoopFileError(f"{path} is not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LoopFileError(f"{path} is not valid YAML: {exc}") from None
    return parse_loop_document(data, source=str(path))


def to_loop_file(name: str, document: Mapping[str, Any]) -> str:
    """A loop's configuration as a loop file (what ``ratchet loop export`` prints)."""
    data: dict[str, Any] = {"schema": LOOP_SCHEMA, "name": name}
    for key in CONFIG_KEYS:
        value = document.get(key)
        if value is not None:
            data[key] = value
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)

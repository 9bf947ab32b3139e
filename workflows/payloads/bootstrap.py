"""Payloads of a bootstrap cycle's activities (workflows/activities/bootstrap.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BootstrapReadinessInput:
    """Whether an automatic bootstrap may start: the loop, the fewest successful
    train-split traces its policy waits for, and how many curated traces the last look saw."""

    loop: str
    min_successes: int
    curated_seen: int = -1


@dataclass
class BootstrapReadiness:
    ready: bool
    # Curated traces now (the next look is skipped while this does not move).
    curated: int
    used: int = 0
    summary: str = ""


@dataclass
class PrepareBootstrapInput:
    """The cycle's demonstrations and base model: the base the request named (None: the
    training profile's) and the most demonstrations to train on."""

    loop: str
    cycle: int
    base_checkpoint_id: str | None
    max_demonstrations: int


@dataclass
class PrepareBootstrapResult:
    """The base model, the demonstrations' task file (None when there are none) and the
    report of the traces seen (services.curation.bootstrap.BootstrapReport as JSON)."""

    base_checkpoint_id: str
    base_uri: str
    demonstrations_uri: str | None
    used: int
    summary: str
    report: dict[str, Any] = field(default_factory=dict)

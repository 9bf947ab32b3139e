"""The list of workflow types and the activity factory the worker registers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workflows.worker import WorkerDependencies

WORKFLOWS: list[type] = []


def build_activities(deps: WorkerDependencies) -> list[Callable[..., Any]]:
    """Instantiate every activity class with its dependencies and return the bound methods."""
    return []

"""The replay gate: committed histories of real runs replay against today's workflow code.

A change that would break running workflows (a reordered activity, a removed timer) fails
here; such a change goes behind ``workflow.patched(...)``. Histories are recorded with
``python -m tests.workflows.record_histories`` and by the end-to-end tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workflows.registry import WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_every_workflow_type_has_a_history() -> None:
    covered = set()
    for path in HISTORIES:
        history = WorkflowHistory.from_json(path.stem, path.read_text())
        first = history.events[0].workflow_execution_started_event_attributes
        covered.add(first.workflow_type.name)
    assert {cls.__name__ for cls in WORKFLOWS} <= covered


@pytest.mark.parametrize("path", HISTORIES, ids=[path.stem for path in HISTORIES])
async def test_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(workflows=list(WORKFLOWS))
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"

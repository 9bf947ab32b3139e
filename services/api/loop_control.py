"""Starting and signalling a loop's workflow (used by the loop and loop-action routes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from services.settings import Settings
from workflows.ids import loop_workflow_id
from workflows.loop import LoopWorkflow
from workflows.payloads.loop import LoopInput


async def start_loop_workflow(client: Client, settings: Settings, name: str) -> str:
    """Start the loop's workflow if it is not running; returns its id. Idempotent."""
    workflow_id = loop_workflow_id(name)
    await client.start_workflow(
        LoopWorkflow.run,
        LoopInput(loop=name),
        id=workflow_id,
        task_queue=settings.temporal_task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )
    return workflow_id


async def signal_loop(
    client: Client, settings: Settings, name: str, signal: Callable[..., None], arg: Any
) -> None:
    """Signal-with-start: an action on a loop whose workflow is not running starts it.

    ``signal`` is the workflow's handler itself (``LoopWorkflow.pause``): signal-with-start
    takes a name, and a handler declared with a bare ``@workflow.signal`` is named after its
    function (tests/test_architecture.py checks that every one is)."""
    await client.start_workflow(
        LoopWorkflow.run,
        LoopInput(loop=name),
        id=loop_workflow_id(name),
        task_queue=settings.temporal_task_queue,
        start_signal=signal.__name__,
        start_signal_args=[arg],
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )

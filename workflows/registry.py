"""The list of workflow types and the activity factory the worker registers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workflows.curate import CurateWorkflow
from workflows.evaluate import EvaluateWorkflow
from workflows.loop import LoopWorkflow
from workflows.probe import ProbeWorkflow
from workflows.promote import PromoteWorkflow
from workflows.retention import RetentionWorkflow
from workflows.train import TrainWorkflow

if TYPE_CHECKING:
    from workflows.worker import WorkerDependencies

WORKFLOWS: list[type] = [
    LoopWorkflow,
    CurateWorkflow,
    ProbeWorkflow,
    TrainWorkflow,
    EvaluateWorkflow,
    PromoteWorkflow,
    RetentionWorkflow,
]


def build_activities(deps: WorkerDependencies) -> list[Callable[..., Any]]:
    """Instantiate every activity class with its dependencies and return the bound methods."""
    from services.curation.workers import shared_pool
    from services.executors import build_executor
    from services.serving.targets import ServingTargets
    from workflows.activities.curation import CurationActivities
    from workflows.activities.jobs import JobActivities
    from workflows.activities.loop import LoopActivities
    from workflows.activities.retention import RetentionActivities

    jobs = JobActivities(
        session_factory=deps.session_factory,
        executors=lambda name: build_executor(name, deps.settings),
        artifacts=deps.artifacts,
        settings=deps.settings,
    )
    curation = CurationActivities(
        deps.session_factory,
        deps.artifacts,
        pool=shared_pool(deps.settings.curation_processes),
    )
    targets = ServingTargets(deps.settings, heartbeat=_heartbeat_if_in_activity)
    loop = LoopActivities(deps.session_factory, targets, prove=targets.prove)
    retention = RetentionActivities(deps.session_factory)
    return [
        *curation.activities(),
        *jobs.activities(),
        *loop.activities(),
        retention.purge_trace_bodies,
    ]


def _heartbeat_if_in_activity(detail: str) -> None:
    """Serving targets call this while a deploy waits (a rollout, a model load), so
    ``deploy_checkpoint`` heartbeats within its heartbeat timeout."""
    from temporalio import activity

    if activity.in_activity():
        activity.heartbeat(detail)

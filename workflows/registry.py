"""The list of workflow types and the activity factory the worker registers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.artifacts import ArtifactStore
from services.db.session import SessionFactory
from services.settings import Settings
from workflows.curate import CurateWorkflow
from workflows.evaluate import EvaluateWorkflow
from workflows.ledger import ServingLedgerWorkflow
from workflows.loop import LoopWorkflow
from workflows.probe import ProbeWorkflow
from workflows.promote import PromoteWorkflow
from workflows.retention import RetentionWorkflow
from workflows.train import TrainWorkflow

WORKFLOWS: list[type] = [
    LoopWorkflow,
    CurateWorkflow,
    ProbeWorkflow,
    TrainWorkflow,
    EvaluateWorkflow,
    PromoteWorkflow,
    RetentionWorkflow,
    ServingLedgerWorkflow,
]


@dataclass
class WorkerDependencies:
    """Everything activities need, built once per worker process."""

    settings: Settings
    session_factory: SessionFactory
    artifacts: ArtifactStore


def build_activities(deps: WorkerDependencies) -> list[Callable[..., Any]]:
    """Instantiate every activity class with its dependencies and return the bound methods."""
    from services.curation.workers import shared_pool
    from services.executors import build_executor
    from services.loop.estimate import Prices
    from services.loop.ledger import ServingLedger, ServingPrices
    from services.serving.targets import ServingTargets
    from workflows.activities.bootstrap import BootstrapActivities
    from workflows.activities.curation import CurationActivities
    from workflows.activities.estimate import EstimateActivities
    from workflows.activities.jobs import JobActivities
    from workflows.activities.retention import RetentionActivities
    from workflows.activities.stages import StageActivities

    jobs = JobActivities(
        session_factory=deps.session_factory,
        executors=lambda name: build_executor(name, deps.settings),
        artifacts=deps.artifacts,
        settings=deps.settings,
        follow_threads=deps.settings.worker_max_jobs,
    )
    curation = CurationActivities(
        deps.session_factory,
        deps.artifacts,
        pool=shared_pool(deps.settings.curation_processes),
    )
    targets = ServingTargets(deps.settings, heartbeat=_heartbeat_if_in_activity)
    prices = ServingPrices(
        hour_usd=deps.settings.serving_hour_price_usd,
        cached_token_weight=deps.settings.serving_cached_token_weight,
    )
    loop = StageActivities.build(
        deps.session_factory,
        targets,
        attestation=targets.attestation,
        serving_ledger=ServingLedger(read=targets.usage, prices=prices),
        prove=targets.prove,
    )
    estimate = EstimateActivities(
        deps.session_factory,
        Prices(deps.settings.accelerator_hour_price_usd, deps.settings.cpu_hour_price_usd),
    )
    retention = RetentionActivities(deps.session_factory)
    bootstrap = BootstrapActivities(deps.session_factory, deps.artifacts)
    return [
        *curation.activities(),
        *bootstrap.activities(),
        *jobs.activities(),
        *loop.activities(),
        *estimate.activities(),
        retention.maintain_partitions,
        retention.purge_trace_bodies,
    ]


def _heartbeat_if_in_activity(detail: str) -> None:
    """Serving targets call this while a deploy waits (a rollout, a model load), so
    ``deploy_checkpoint`` heartbeats within its heartbeat timeout."""
    from temporalio import activity

    if activity.in_activity():
        activity.heartbeat(detail)

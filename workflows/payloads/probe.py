"""Payloads of the difficulty probe: ProbeWorkflow's input and result and its activities'."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.loop.policies import (
    TrainingProfile,
)
from services.loop.states import ProbeStatus
from workflows.payload import policy_payload


@policy_payload()
@dataclass
class ProbeInput:
    """Probe the champion on the loop's unprobed train tasks (``ProbeWorkflow``)."""

    loop: str
    cycle: int
    environment: str
    champion_checkpoint_id: str
    champion_uri: str
    attempts: int = 8
    profile: TrainingProfile = field(default_factory=TrainingProfile)


@dataclass
class ProbeResult:
    """What the probe did: ``skipped`` (nothing to probe), ``succeeded``, or the job's end."""

    status: ProbeStatus
    run_id: str | None = None
    probed: int = 0
    recorded: int = 0
    too_easy: int = 0
    too_hard: int = 0
    kept: int = 0
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None


@dataclass
class ExportProbeTasksInput:
    """Write the loop's unprobed train tasks to the probe run's task file."""

    loop: str
    run_id: str
    # Each probed task's pass rate travels through the workflow's history, so one probe
    # takes at most this many tasks (and never more than ``max_train_tasks``).
    max_tasks: int = 5_000


@dataclass
class ExportProbeTasksResult:
    task_uri: str | None  # None when no train task is unprobed
    count: int
    task_ids: list[int] = field(default_factory=list)


@dataclass
class ProbePassRatesInput:
    """Read a finished probe job's per-task results as pass rates of the exported tasks."""

    loop: str
    output_uri: str
    task_ids: list[int]


@dataclass
class ProbePassRatesResult:
    pass_rates: dict[int, float]
    too_easy: int = 0
    too_hard: int = 0
    kept: int = 0


@dataclass
class RecordProbesInput:
    loop: str
    pass_rates: dict[int, float]


@dataclass
class RecordProbesResult:
    updated: int

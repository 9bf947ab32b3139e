"""Payloads of a job: the job activities' input and result, and the job a cycle's stage runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from services.loop.policies import (
    JobOverride,
    TrainingProfile,
)
from services.loop.states import RunStatus

# The job contract's spec builders (re-exported for the workflows): standard library only.
from services.training.jobspec import eval_job_document as eval_job_document
from services.training.jobspec import train_job_document as train_job_document
from workflows.ids import uri_path


@dataclass
class RunJobInput:
    """Run one job to completion on the loop's executor (submit, or adopt if it exists)."""

    run_id: str
    loop: str
    kind: str  # "train" | "eval" | "probe" | "calibrate"
    job_spec: dict[str, Any]
    cycle: int | None = None
    dataset_id: int | None = None
    base_checkpoint_id: str | None = None
    accelerators: int = 0
    poll_interval_s: float = 1.0
    # The loop's own job image and command (training_profile.train_job / eval_job), if any.
    job_image: str | None = None
    job_command: list[str] | None = None
    # The longest the job may run, from its first start (kept across attempts): past it the
    # job is stopped and the run fails, so a job adopted by a retry cannot outlive its bound.
    deadline_s: float | None = None


def job_override(override: JobOverride | None) -> tuple[str | None, list[str] | None]:
    """The image and command of a profile's ``train_job`` or ``eval_job``, if set."""
    if override is None:
        return None, None
    return override.image, list(override.command) if override.command else None


class CycleJobStage(Protocol):
    """A stage input that runs a job of its cycle (``TrainInput``, ``EvaluateInput``,
    ``ProbeInput``): the loop, the cycle, its environment and the loop's training profile."""

    loop: str
    cycle: int
    environment: str
    profile: TrainingProfile


def cycle_job(
    stage: CycleJobStage,
    kind: str,
    run_id: str,
    job_spec: dict[str, Any],
    *,
    base_checkpoint_id: str | None,
    dataset_id: int | None = None,
) -> RunJobInput:
    """A job of a cycle's stage as the loop's profile runs it: training (and its calibration
    pass) takes ``accelerators`` and the ``train_job`` override, eval and probe jobs
    ``eval_accelerators`` and the ``eval_job`` override."""
    profile = stage.profile
    training = kind in ("train", "calibrate")
    image, command = job_override(profile.train_job if training else profile.eval_job)
    accelerators = profile.accelerators if training else profile.eval_accelerators
    return RunJobInput(
        run_id=run_id,
        loop=stage.loop,
        kind=kind,
        job_spec=job_spec,
        cycle=stage.cycle,
        dataset_id=dataset_id,
        base_checkpoint_id=base_checkpoint_id,
        accelerators=accelerators,
        job_image=image,
        job_command=command,
    )


def cycle_eval_job_spec(
    stage: CycleJobStage,
    run_id: str,
    *,
    checkpoint_uri: str,
    task_uri: str,
    samples: int,
    temperature: float,
) -> dict[str, object]:
    """The eval job's spec (an evaluation, or a probe) for one checkpoint on one task file.

    The seed is the cycle: every checkpoint of a cycle is sampled with the same random numbers.
    """
    return eval_job_document(
        run_id=run_id,
        environment=stage.environment,
        checkpoint=uri_path(checkpoint_uri),
        dataset=uri_path(task_uri),
        samples=samples,
        seed=stage.cycle,
        device=stage.profile.device,
        temperature=temperature,
    )


@dataclass
class RunJobResult:
    run_id: str
    status: RunStatus  # a terminal one
    output_uri: str
    metrics: dict[str, Any] = field(default_factory=dict)
    compute_seconds: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None


class JobOutcome(TypedDict):
    """How a job ended, as every stage result that ran one reports it (``TrainResult``,
    ``ProbeResult``): ``StageResult(..., **job_outcome(job))``."""

    status: RunStatus
    compute_seconds: float
    cost_usd: float
    error: str | None


def job_outcome(job: RunJobResult) -> JobOutcome:
    return JobOutcome(
        status=job.status,
        compute_seconds=job.compute_seconds,
        cost_usd=job.cost_usd,
        error=job.error,
    )


@dataclass
class CancelJobInput:
    run_id: str
    loop: str


@dataclass
class RegisterCheckpointInput:
    """Verify a job's checkpoint dir and copy it into the content-addressed store."""

    loop: str
    run_id: str
    checkpoint_dir_uri: str
    parent_checkpoint_id: str | None = None


@dataclass
class RegisterCheckpointResult:
    checkpoint_id: str
    uri: str
    size_bytes: int

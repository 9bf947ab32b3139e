"""The calibration pass: a train job's own model, shapes and executor, timed for a moment.

A loop's first estimate has measured nothing (services.loop.estimate): its per-unit rates
were defaults, which missed a toy cycle by x52 and a SmolLM2 one by x6.5 the other way. So
before a loop's first estimate the cycle runs its train job once with ``"calibrate": true``
in the spec, and the job trains a shortened copy of itself: every stage of the profile with
the same model, sampling settings (samples per task, turns, new tokens, rollout batch) and
batch shapes, but at most :data:`CALIBRATION_STEPS` steps and one round per stage, on as many
of the dataset's tasks as one rollout batch holds. It loads the base, samples, steps and
saves like the real job, so its ``metrics.json`` phases and units (episodes, steps, one job)
give the loop rates per episode, per step and per job on this executor, which the estimate
prices the cycle's planned work at.

Torch-free and database-free, like the job that calls it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from services.environments.base import TaskSpec
from services.training.config import GRPOConfig, Hyperparameters, SamplingOptions

CALIBRATION_STEPS = 2


def calibration_tasks(hypers: Sequence[Hyperparameters]) -> int:
    """How many tasks the pass needs: enough for one full rollout batch of every sampling
    stage (rft, dpo) and every step of a GRPO stage, at least one."""
    needed = 1
    for hyper in hypers:
        config = hyper.config
        if isinstance(config, GRPOConfig):
            needed = max(needed, config.tasks_per_step)
        elif isinstance(config, SamplingOptions):
            needed = max(needed, math.ceil(config.rollout_batch / config.samples_per_task))
    return needed


def calibration_plan(
    hypers: Sequence[Hyperparameters], tasks: Sequence[TaskSpec]
) -> tuple[list[Hyperparameters], list[TaskSpec]]:
    """The stages shortened to :data:`CALIBRATION_STEPS` steps and one round each, and the
    first :func:`calibration_tasks` tasks (the dataset's order is the snapshot's, fixed)."""
    shortened = []
    for hyper in hypers:
        names = {f.name for f in fields(hyper.config)}
        changes: dict[str, int] = {"steps": min(int(hyper.config.steps), CALIBRATION_STEPS)}
        if "iterations" in names:
            changes["iterations"] = 1
        config: Any = hyper.config  # a checked dataclass: replace() checks its bounds again
        shortened.append(replace(hyper, config=replace(config, **changes)))
    return shortened, list(tasks[: calibration_tasks(hypers)])

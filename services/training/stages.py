"""One stage of a train job: what the job hands an algorithm's trainer, what it gets back,
and the stage functions of the built-in algorithms.

The registry (:data:`services.training.config.ALGORITHMS`) names each algorithm's stage
function as ``"module:function"``; :func:`stage_trainer` imports it. The job does the rest
the same way for every algorithm: it loads the base checkpoint (or, for an algorithm that
may start from scratch, builds a fresh model), runs the stages of a chain in order on the
same model, and saves the checkpoint and metrics.json. A stage function trains
``run.model`` in place and returns its metrics, which must hold ``steps``, ``train_tokens``
and ``rollout_tokens`` (the job and a chain sum them) and may hold any key of
:data:`services.training.job.STAGE_KEYS`, which a chain reports per stage. A stage that
sampled on another engine (the remote backend) reports ``sampler_mismatch``: a row per
step (grpo) or rollout call (rft, dpo), see :mod:`services.training.mismatch`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.environments.base import Environment, TaskSpec
from services.training.config import (
    ALGORITHMS,
    DPOConfig,
    GRPOConfig,
    HFSFTConfig,
    Hyperparameters,
    MismatchOptions,
    RFTConfig,
    SFTConfig,
    known_keys,
)
from services.training.distributed import DistContext
from services.training.dpo import train_dpo
from services.training.episode_file import EpisodeRecord
from services.training.family import DemonstrationOptions, FamilyModel
from services.training.grpo import train_grpo
from services.training.jobspec import JobError
from services.training.keep import EpisodeKeeper
from services.training.mismatch import MismatchGuard, MismatchWatch
from services.training.rft import train_rft
from services.training.sft import train_sft


@dataclass(frozen=True)
class StageRun:
    """What one stage gets: the environment and tasks, the model to train in place, the
    stage's checked hyper-parameters, the process group, and a directory of its own for
    resume points (a resumable trainer continues from the last one after a restart)."""

    env: Environment
    tasks: list[TaskSpec]
    model: FamilyModel
    hyper: Hyperparameters
    ctx: DistContext
    state_dir: Path
    # Earlier runs' verified episodes (spec ``demonstrations``) and what this run keeps of
    # its own (spec ``keep_episodes``): rft and dpo train on the first, every sampler fills
    # the second.
    stored: list[EpisodeRecord] = field(default_factory=list)
    keeper: EpisodeKeeper | None = None
    # Tasks the starting weights already handle (spec ``replay_dataset``: a dataset's replay
    # split, never the regression suite that judges the candidate), which rft replays so
    # that it does not forget them.
    replay_tasks: list[TaskSpec] = field(default_factory=list)


@dataclass(frozen=True)
class StageResult:
    """A stage's metrics (see the module docstring) and its trainer's seconds per phase
    (rollout, scoring, update; a trainer that times none reports none: its time is the
    run's ``other``)."""

    metrics: dict[str, Any]
    phases: dict[str, float] = field(default_factory=dict)


StageTrainer = Callable[[StageRun], StageResult]


def stage_trainer(algorithm: str) -> StageTrainer:
    """The stage function the registry names for ``algorithm`` (a checked name)."""
    reference = ALGORITHMS[algorithm].trainer
    module_name, _, name = reference.partition(":")
    try:
        trainer = getattr(importlib.import_module(module_name), name, None)
    except ImportError as exc:
        raise ValueError(f"algorithm {algorithm!r}: cannot import {reference}: {exc}") from None
    if not callable(trainer):
        raise ValueError(f"algorithm {algorithm!r}: {reference} is not a function")
    return trainer


def grpo_stage(run: StageRun) -> StageResult:
    """GRPO (:mod:`services.training.grpo`), resuming under ``run.state_dir``."""
    config = run.hyper.config
    assert isinstance(config, GRPOConfig)  # the registry's class for grpo
    result = train_grpo(
        run.model,
        run.env,
        run.tasks,
        config,
        ctx=run.ctx,
        state_dir=run.state_dir,
        keeper=run.keeper,
    )
    history = result.counters.history
    metrics = {
        **result.counters.metrics(),
        "resumed_from_step": result.resumed_from_step,
        "final_loss": history[-1]["loss"] if history else None,
        "final_reward": result.final_reward,
        "final_pass_rate": result.final_pass_rate,
        "successes": int(sum(row.get("successes", 0.0) for row in history)),
        "hyperparameters": config.to_dict(),
    }
    if result.sampler_mismatch:
        metrics["sampler_mismatch"] = result.sampler_mismatch
    return StageResult(metrics, result.counters.phase_s)


def sft_stage(run: StageRun) -> StageResult:
    """SFT (:mod:`services.training.sft`) on the environment's demonstrations of the tasks."""
    config = run.hyper.config
    assert isinstance(config, SFTConfig)
    augment = run.hyper.options.augment_fraction
    options = DemonstrationOptions(
        seed=config.seed,
        augment_fraction=augment,
        recovery_fraction=config.recovery_fraction if isinstance(config, HFSFTConfig) else 0.0,
    )
    try:
        sequences = run.model.demonstrations(run.env, run.tasks, options)
    except (NotImplementedError, ValueError) as exc:
        raise JobError(f"cannot build demonstrations: {exc}") from None
    result = train_sft(run.model, sequences, config, ctx=run.ctx)
    hyperparameters = config.to_dict()
    if "augment_fraction" in known_keys(run.model.family, "sft"):  # a job option of this family
        hyperparameters["augment_fraction"] = augment
    metrics = {
        **result.metrics(),
        "final_loss": result.final_loss,
        "final_reward": None,
        "final_pass_rate": None,
        "demonstrations": len(sequences),
        "hyperparameters": hyperparameters,
    }
    return StageResult(metrics, result.phase_s)


def rft_stage(run: StageRun) -> StageResult:
    """RFT (:mod:`services.training.rft`): its sampling is the rollout phase, its SFT the
    update phase."""
    config = run.hyper.config
    assert isinstance(config, RFTConfig)
    model, guard = _watched(run, config.rollout_batch)
    rft = train_rft(
        model,
        run.env,
        run.tasks,
        config,
        ctx=run.ctx,
        stored=run.stored,
        keeper=run.keeper,
        replay_tasks=run.replay_tasks,
    )
    metrics = {**rft.metrics(), "final_reward": None, "hyperparameters": config.to_dict()}
    return StageResult(metrics | _mismatch_rows(guard), rft.counters.phase_s)


def dpo_stage(run: StageRun) -> StageResult:
    """DPO (:mod:`services.training.dpo`): its sampling is the rollout phase, the
    reference's scores the scoring phase, its steps the update phase."""
    config = run.hyper.config
    assert isinstance(config, DPOConfig)
    model, guard = _watched(run, config.micro_batch)
    dpo = train_dpo(
        model, run.env, run.tasks, config, ctx=run.ctx, stored=run.stored, keeper=run.keeper
    )
    metrics = {**dpo.metrics(), "final_reward": None, "hyperparameters": config.to_dict()}
    return StageResult(metrics | _mismatch_rows(guard), dpo.counters.phase_s)


def _watched(run: StageRun, micro_batch: int) -> tuple[FamilyModel, MismatchGuard | None]:
    """The stage's model, checked against the engine that samples for it when that is
    another (services.training.mismatch): rft and dpo sample through the model."""
    config = run.hyper.config
    if not isinstance(config, MismatchOptions):  # a family that only samples in the job
        return run.model, None
    guard = MismatchGuard(config.mismatch_threshold)
    return MismatchWatch(run.model, guard, run.ctx, micro_batch=micro_batch), guard


def _mismatch_rows(guard: MismatchGuard | None) -> dict[str, Any]:
    """metrics.json's ``sampler_mismatch``: a row per batch another engine sampled."""
    return {"sampler_mismatch": guard.rows} if guard is not None and guard.rows else {}

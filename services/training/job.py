"""The train job: ``python -m services.training.job --spec spec.json`` (or ``ratchet job train``).

Spec (``ratchet.job/v1``, kind ``train``)::

    {"schema": "ratchet.job/v1", "kind": "train", "run_id": "r-1", "algorithm": "grpo",
     "environment": "toolcalc", "dataset": "tasks.jsonl", "base_checkpoint": "ckpt/",
     "output_dir": "out/", "hyperparameters": {...}, "seed": 0, "device": "auto"}

``RATCHET_DATASET``, ``RATCHET_BASE_CHECKPOINT`` and ``RATCHET_OUTPUT_DIR`` override the
paths. ``algorithm`` is a name of the registry (:data:`services.training.config.ALGORITHMS`:
``grpo``, ``sft``, ``rft``, ``dpo``; each runs through its stage function, see
:mod:`services.training.stages`), or a chain of them
(``["rft", "grpo"]``: each stage from the previous stage's weights; a key ``"rft.steps"`` is
one stage's, a plain key every stage's that takes it; metrics.json's ``stages`` says what
each stage saw and did). ``grpo``, ``rft`` and ``dpo`` need a dataset and a base checkpoint;
``sft`` needs a dataset and starts from the base checkpoint when one is given, else from a
fresh model (``hyperparameters.model`` sets its shape). Outputs:
``<output_dir>/checkpoint/`` and ``<output_dir>/metrics.json``; with ``keep_episodes`` =
N in the spec, ``<output_dir>/episodes.jsonl`` too (up to N verified successes of each task
and as many failures beside them, with their token ids; listed in metrics.json as
``episode_file``, see services.training.episode_file); a replay job adds what its sandbox
learned (``unanswerable_calls`` per task, and ``tool_answers``: the listing of
``<output_dir>/tool_answers.jsonl``, the live tool answers it got, see
services.environments.replay.sandbox); ``demonstrations`` in the spec names
earlier runs' stored episodes, which rft trains on and dpo pairs; ``replay_dataset`` names a
task file of tasks the starting weights already handle (a dataset's replay split, never the
regression suite that judges the candidate), which rft replays beside the new successes
(``replay_fraction``) so that it does not forget them.
``"calibrate": true`` makes it a calibration pass: the same stages, shortened to a couple of
steps on as many tasks as one rollout batch holds (services.training.calibration), whose
metrics.json times the job's phases for a loop's first estimate.
GRPO keeps resume points under ``<output_dir>/state/`` and a restarted job continues from the
last one. A job whose outputs are already complete exits 0 without retraining, so an
executor may retry it safely.
Under ``torchrun`` every rank trains and rank 0 writes (an hf model with ``sharding: fsdp``
is sharded over the ranks, and its weights are gathered to rank 0 to be written).
metrics.json reports each rank's ``peak_memory`` and, when rollouts came from another engine
(``rollout_backend``), the ``sampler_mismatch`` of every step; a mismatch over the
threshold fails the job with the version the sampler served (services.training.mismatch).

The model family is the base checkpoint's (``tiny`` without one; an optional spec
``family`` must agree), looked up in :func:`services.training.family.family_for`; the
trainers are the same for every family. ``base_model`` in the spec (or
``RATCHET_BASE_MODEL``) is the directory of an hf adapter champion's base when it does not
lie beside the adapter in the checkpoint store.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from services.environments.base import Environment, TaskFileError, TaskSpec, read_task_file
from services.environments.registry import get_environment
from services.inference.remote import RemoteError, attach_rollout_backend
from services.training.calibration import calibration_plan
from services.training.checkpoint import CheckpointError, read_manifest, verify_checkpoint
from services.training.config import (
    ALGORITHMS,
    HyperparameterError,
    Hyperparameters,
    algorithm_chain,
)
from services.training.device import use_threads
from services.training.distributed import (
    DistContext,
    init_job_distributed,
    is_sharded,
    peak_memory,
    shutdown_distributed,
)
from services.training.episode_file import (
    EpisodeFileError,
    EpisodeRecord,
    keep_episodes_option,
    read_demonstrations,
    write_episodes,
)
from services.training.family import Family, FamilyModel, family_for, family_names
from services.training.jobspec import (
    EXIT_FAILED,
    JobError,
    JobSpec,
    environment_outputs,
    job_hyperparameters,
    read_job_dataset,
    run_job_main,
    write_json,
)
from services.training.keep import EpisodeKeeper
from services.training.mismatch import SamplerMismatch
from services.training.optim import TrainingDiverged
from services.training.phases import PhaseClock, phase_report
from services.training.stages import StageResult, StageRun, stage_trainer

logger = logging.getLogger("services.training.job")


def train_job_main(argv: list[str]) -> int:
    """Run a train job; returns the process exit code."""
    return run_job_main(argv, kind="train", run=_run, finally_=shutdown_distributed)


def _run(spec: JobSpec) -> int:
    algorithm = spec.raw.get("algorithm")
    try:
        stages = algorithm_chain(algorithm)
    except HyperparameterError as exc:
        raise JobError(exc.message) from None
    env = _environment(spec.environment)
    checkpoint_dir = spec.output_dir / "checkpoint"
    metrics_path = spec.output_dir / "metrics.json"
    if metrics_path.is_file() and (checkpoint_dir / "manifest.json").is_file():
        verify_checkpoint(checkpoint_dir)
        logger.info("outputs of run %s are already complete in %s", spec.run_id, spec.output_dir)
        return 0
    tasks = _dataset(spec)
    replay_tasks = _replay_tasks(spec)
    family_name = _base_family(spec)
    hypers = job_hyperparameters(spec, family=family_name, algorithm=algorithm)
    calibrating = _calibrating(spec)
    if calibrating:  # services.training.calibration: the same job, shortened
        hypers, tasks = calibration_plan(hypers, tasks)
        replay_tasks = []
    use_threads(hypers[0].options.threads)
    ctx = init_job_distributed(spec.device)
    # Loading the base and saving the result are the job's weight movement ("sync"); the
    # trainers time their own phases (and a resumed run's from its resume point).
    clock = PhaseClock(ctx.device)
    with clock.phase("sync"):
        model = _initial_model(spec, stages[0], family_for(family_name), hypers[0], ctx)
    try:  # rollouts on an OpenAI-compatible server (vLLM) instead of in this job
        attach_rollout_backend(model, spec.raw.get("rollout_backend"), os.environ)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    parent = model.checkpoint_id
    run = StageRun(
        env,
        tasks,
        model,
        hypers[0],
        ctx,
        state_dir=spec.output_dir / "state",
        stored=_stored(spec),
        keeper=_keeper(spec, model),
        replay_tasks=replay_tasks,
    )
    started = time.monotonic()
    result = _train(run, stages, hypers)
    metrics = result.metrics
    metrics["wall_s"] = round(time.monotonic() - started, 3)
    metrics.update(
        run_id=spec.run_id,
        kind="train",
        algorithm=stages[0] if isinstance(algorithm, str) else list(stages),
        family=family_name,
        environment=env.name,
        device=str(ctx.device),
        world_size=ctx.world_size,
        tasks=len(tasks),
        parent_checkpoint_id=parent,
        schema="ratchet.metrics/v1",
        calibration=calibrating,
    )
    total_tokens = metrics["train_tokens"] + metrics["rollout_tokens"]
    metrics["tokens_per_s"] = (
        round(total_tokens / metrics["wall_s"], 1) if metrics["wall_s"] else 0.0
    )
    metrics["sharding"] = "fsdp" if is_sharded(model) else "none"
    metrics["peak_memory"] = peak_memory(ctx)  # a collective: every rank reports its own
    if ctx.is_main:
        metrics.update(_kept_episodes(spec, run.keeper))
        metrics.update(environment_outputs(env, spec.output_dir))
    _save(spec, model, StageResult(metrics, result.phases), clock=clock, ctx=ctx)
    ctx.barrier()
    return 0


def _train(run: StageRun, stages: tuple[str, ...], hypers: list[Hyperparameters]) -> StageResult:
    """The job's one stage or its chain, with the failures a trainer may meet as job errors."""
    try:
        if len(stages) == 1:
            return stage_trainer(stages[0])(run)
        return _train_chain(run, stages, hypers)
    except TrainingDiverged as exc:
        raise JobError(str(exc), exit_code=EXIT_FAILED) from None
    except RemoteError as exc:
        raise JobError(f"remote rollouts failed: {exc}", exit_code=EXIT_FAILED) from None
    except SamplerMismatch as exc:  # the sampler serves other weights than the trainer's
        raise JobError(str(exc), exit_code=EXIT_FAILED) from None
    except ValueError as exc:  # e.g. an environment without the family's rendering
        raise JobError(str(exc)) from None


def _save(
    spec: JobSpec, model: FamilyModel, result: StageResult, *, clock: PhaseClock, ctx: DistContext
) -> None:
    """Write the checkpoint (over a killed run's partial one) and metrics.json, last: a job
    whose metrics.json is there is complete. Every rank calls it; rank 0 writes (a sharded
    model's weights are gathered from every rank for it)."""
    metrics = result.metrics
    checkpoint_dir = spec.output_dir / "checkpoint"
    meta: dict[str, object] = {
        "algorithm": metrics["algorithm"],
        "run_id": spec.run_id,
        "steps": metrics["steps"],
    }
    if not ctx.is_main and not is_sharded(model):
        return
    with clock.phase("sync"):
        if ctx.is_main and checkpoint_dir.exists():
            _remove_partial(checkpoint_dir)
        manifest = model.save(checkpoint_dir, parent=metrics["parent_checkpoint_id"], metadata=meta)
    if not ctx.is_main:
        return
    metrics["checkpoint_id"] = manifest.checkpoint_id
    metrics["phases"] = phase_report(clock, result.phases, world_size=ctx.world_size)
    write_json(spec.output_dir / "metrics.json", metrics)
    logger.info("run %s wrote checkpoint %s", spec.run_id, manifest.checkpoint_id)


# What each stage of a chain reports in metrics.json's ``stages`` (beside its algorithm).
STAGE_KEYS = (
    "steps",
    "episodes",
    "successes",
    "pairs",
    "demonstrations",
    "final_loss",
    "final_pass_rate",
    "train_tokens",
    "rollout_tokens",
    "trained",
    "iterations",
    "history",
    "hyperparameters",
    "sampler_mismatch",
)


def _train_chain(
    first: StageRun, stages: tuple[str, ...], hypers: list[Hyperparameters]
) -> StageResult:
    """Each stage on the previous stage's weights; the totals, and what each stage saw and
    did under ``stages``. A GRPO stage resumes under ``state/stage-<n>-grpo``; a restarted
    job reruns the stages before it, which give the same weights (every stage is seeded)."""
    reports: list[dict[str, Any]] = []
    phases: dict[str, float] = {}
    for index, (algorithm, hyper) in enumerate(zip(stages, hypers, strict=True)):
        state_dir = first.state_dir / f"stage-{index + 1}-{algorithm}"
        result = stage_trainer(algorithm)(replace(first, hyper=hyper, state_dir=state_dir))
        for name, value in result.phases.items():
            phases[name] = phases.get(name, 0.0) + value
        reports.append(
            {"stage": index + 1, "algorithm": algorithm}
            | {key: result.metrics[key] for key in STAGE_KEYS if key in result.metrics}
        )
        if first.ctx.is_main:
            logger.info("stage %d/%d (%s) done", index + 1, len(stages), algorithm)
    last = reports[-1]
    totals = {
        "steps": sum(r["steps"] for r in reports),
        "train_tokens": sum(r["train_tokens"] for r in reports),
        "rollout_tokens": sum(r["rollout_tokens"] for r in reports),
        "episodes": sum(r.get("episodes", 0) for r in reports),
        "final_loss": last.get("final_loss"),
        "final_pass_rate": last.get("final_pass_rate"),
        "stages": reports,
    }
    mismatch = [
        {**row, "where": f"stage {r['stage']} ({r['algorithm']}) {row['where']}"}
        for r in reports
        for row in r.get("sampler_mismatch", [])
    ]
    if mismatch:
        totals["sampler_mismatch"] = mismatch
    return StageResult(totals, phases)


def _calibrating(spec: JobSpec) -> bool:
    """The spec's ``calibrate``: a short timed pass of this job (services.training.calibration)
    rather than the job itself."""
    value = spec.raw.get("calibrate", False)
    if not isinstance(value, bool):
        raise JobError(f"spec 'calibrate' must be true or false, got {value!r}")
    return value


def _stored(spec: JobSpec) -> list[EpisodeRecord]:
    """The spec's ``demonstrations`` file (earlier runs' verified episodes), or none."""
    path = spec.raw.get("demonstrations")
    if path is None:
        return []
    if not isinstance(path, str) or not path:
        raise JobError("spec 'demonstrations' must be the path of a demonstrations file")
    try:
        return read_demonstrations(Path(path))
    except EpisodeFileError as exc:
        raise JobError(str(exc)) from None


def _keeper(spec: JobSpec, model: FamilyModel) -> EpisodeKeeper | None:
    """What the run keeps of its verified episodes (spec ``keep_episodes`` per task)."""
    try:
        per_task = keep_episodes_option(spec.raw)
    except EpisodeFileError as exc:
        raise JobError(str(exc)) from None
    return EpisodeKeeper(model, per_task=per_task, failures_alone=False) if per_task else None


def _kept_episodes(spec: JobSpec, keeper: EpisodeKeeper | None) -> dict[str, Any]:
    """Write what the run kept (``episodes.jsonl``); the metrics key that lists it."""
    if keeper is None:
        return {}
    return {"episode_file": write_episodes(spec.output_dir, keeper.records())}


def _base_family(spec: JobSpec) -> str:
    """The model family the job trains: the base checkpoint's (``tiny`` without one); a
    ``family`` the spec declares must agree."""
    declared = spec.raw.get("family")
    if declared is not None and declared not in family_names():
        raise JobError(
            f"unknown model family {declared!r} in the spec; known: {', '.join(family_names())}"
        )
    if spec.base_checkpoint is None or not spec.base_checkpoint.is_dir():
        family = declared or "tiny"
        if family != "tiny":
            raise JobError(f"{family} training needs a base checkpoint: set 'base_checkpoint'")
        return "tiny"
    try:
        family = read_manifest(spec.base_checkpoint).family
    except CheckpointError as exc:
        raise JobError(f"base checkpoint rejected: {exc}") from None
    if declared is not None and declared != family:
        raise JobError(
            f"spec 'family' is {declared!r} but the base checkpoint's family is {family!r}"
        )
    return family


def _initial_model(
    spec: JobSpec, algorithm: str, family: Family, hyper: Hyperparameters, ctx: DistContext
) -> FamilyModel:
    """The base checkpoint with its trainable setup (its first stage's), or (a first stage
    whose algorithm may start from scratch: SFT) a fresh model: the others learn from what
    the model samples."""
    torch.manual_seed(spec.seed)  # a fresh model's or a new LoRA adapter's initial weights
    if spec.base_checkpoint is None:
        if not ALGORITHMS[algorithm].from_scratch:
            raise JobError(
                f"{algorithm} needs a base checkpoint: set 'base_checkpoint' or "
                "RATCHET_BASE_CHECKPOINT"
            )
        try:
            return family.create(hyper.options.model, seed=spec.seed, device=ctx.device)
        except ValueError as exc:
            raise JobError(str(exc)) from None
    if not spec.base_checkpoint.is_dir():
        raise JobError(f"base checkpoint {spec.base_checkpoint} does not exist")
    try:
        return family.load(
            spec.base_checkpoint, device=ctx.device, base_dir=spec.base_model, training=hyper.config
        )
    except CheckpointError as exc:
        raise JobError(f"base checkpoint rejected: {exc}") from None
    except ValueError as exc:  # e.g. LoRA target modules the architecture lacks
        raise JobError(str(exc)) from None


def _environment(name: str) -> Environment:
    try:
        return get_environment(name)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def _dataset(spec: JobSpec) -> list[TaskSpec]:
    return _of_job_environment(read_job_dataset(spec), spec, "dataset")


def _replay_tasks(spec: JobSpec) -> list[TaskSpec]:
    """The spec's ``replay_dataset``: tasks the starting weights already handle (a dataset's
    replay split), which rft replays; none without one, and an empty file is none."""
    path = spec.raw.get("replay_dataset")
    if path is None:
        return []
    if not isinstance(path, str) or not path:
        raise JobError("spec 'replay_dataset' must be the path of a task file")
    if not Path(path).is_file():
        raise JobError(f"replay_dataset {path} does not exist")
    try:
        tasks = read_task_file(Path(path))
    except TaskFileError as exc:
        raise JobError(f"invalid replay_dataset: {exc}") from None
    return _of_job_environment(tasks, spec, "replay_dataset")


def _of_job_environment(tasks: list[TaskSpec], spec: JobSpec, name: str) -> list[TaskSpec]:
    foreign = {t.environment for t in tasks} - {spec.environment}
    if foreign:
        raise JobError(
            f"{name} has tasks of environment(s) {sorted(foreign)}, job is {spec.environment}"
        )
    return tasks


def _remove_partial(checkpoint_dir: Path) -> None:
    """A checkpoint dir left by a killed run (no metrics.json yet) is rewritten from scratch."""
    shutil.rmtree(checkpoint_dir)


def main() -> None:
    raise SystemExit(train_job_main(sys.argv[1:]))


if __name__ == "__main__":
    main()

"""The train job: ``python -m services.training.job --spec spec.json`` (or ``ratchet job train``).

Spec (``ratchet.job/v1``, kind ``train``)::

    {"schema": "ratchet.job/v1", "kind": "train", "run_id": "r-1", "algorithm": "grpo",
     "environment": "toolcalc", "dataset": "tasks.jsonl", "base_checkpoint": "ckpt/",
     "output_dir": "out/", "hyperparameters": {...}, "seed": 0, "device": "auto"}

``RATCHET_DATASET``, ``RATCHET_BASE_CHECKPOINT`` and ``RATCHET_OUTPUT_DIR`` override the
paths. ``grpo`` needs a dataset and a base checkpoint; ``sft`` needs a dataset and starts
from the base checkpoint when one is given, else from a fresh model (``hyperparameters.model``
sets its shape). Outputs: ``<output_dir>/checkpoint/`` and ``<output_dir>/metrics.json``;
GRPO keeps resume points under ``<output_dir>/state/`` and a restarted job continues from
the last one. A job whose outputs are already complete exits 0 without retraining, so an
executor may retry it safely. Under ``torchrun`` every rank trains and rank 0 writes.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from services.environments.base import Environment, TaskSpec
from services.environments.registry import get_environment
from services.training.checkpoint import (
    CheckpointError,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from services.training.config import TrainerConfig
from services.training.distributed import (
    DistContext,
    init_job_distributed,
    shutdown_distributed,
)
from services.training.grpo import GRPOConfig, train_grpo
from services.training.jobspec import (
    EXIT_FAILED,
    JobError,
    JobSpec,
    job_hyperparameters,
    read_job_dataset,
    run_job_main,
    write_json,
)
from services.training.model import GPT, GPTConfig, TinyModel
from services.training.optim import TrainingDiverged
from services.training.sft import SFTConfig, demonstration_sequences, train_sft
from services.training.tokenizer import ByteTokenizer

logger = logging.getLogger("services.training.job")

ALGORITHMS = ("grpo", "sft")


def train_job_main(argv: list[str]) -> int:
    """Run a train job; returns the process exit code."""
    return run_job_main(argv, kind="train", run=_run, finally_=shutdown_distributed)


def _run(spec: JobSpec) -> int:
    algorithm = spec.raw.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise JobError(f"unknown algorithm {algorithm!r} (expected one of {', '.join(ALGORITHMS)})")
    env = _environment(spec.environment)
    checkpoint_dir = spec.output_dir / "checkpoint"
    metrics_path = spec.output_dir / "metrics.json"
    if metrics_path.is_file() and (checkpoint_dir / "manifest.json").is_file():
        verify_checkpoint(checkpoint_dir)
        logger.info("outputs of run %s are already complete in %s", spec.run_id, spec.output_dir)
        return 0
    tasks = _dataset(spec)
    family = _base_family(spec)
    hyper = job_hyperparameters(spec, family=family, algorithm=algorithm)
    if hyper.options.threads is not None:
        torch.set_num_threads(hyper.options.threads)
    if family == "hf":
        return _run_hf(spec, algorithm, env, tasks, hyper.config, checkpoint_dir, metrics_path)
    model, parent = _initial_model(spec, algorithm, hyper.options.model)
    ctx = init_job_distributed(spec.device)
    started = time.monotonic()
    try:
        config = hyper.config
        if isinstance(config, GRPOConfig):
            metrics = _train_grpo(spec, env, tasks, model, parent, config, ctx)
        elif isinstance(config, SFTConfig):
            augment = hyper.options.augment_fraction
            metrics = _train_sft(spec, env, tasks, model, config, augment, ctx)
        else:  # parse_hyperparameters gives a tiny family a tiny config
            raise JobError(f"{type(config).__name__} is not a tiny trainer's config")
    except TrainingDiverged as exc:
        raise JobError(str(exc), exit_code=EXIT_FAILED) from None
    metrics["wall_s"] = round(time.monotonic() - started, 3)
    metrics.update(
        run_id=spec.run_id,
        kind="train",
        algorithm=algorithm,
        environment=env.name,
        device=str(ctx.device),
        world_size=ctx.world_size,
        tasks=len(tasks),
        parent_checkpoint_id=parent,
        schema="ratchet.metrics/v1",
    )
    total_tokens = metrics["train_tokens"] + metrics["rollout_tokens"]
    metrics["tokens_per_s"] = (
        round(total_tokens / metrics["wall_s"], 1) if metrics["wall_s"] else 0.0
    )
    if ctx.is_main:
        meta = {"algorithm": algorithm, "run_id": spec.run_id, "steps": metrics["steps"]}
        if checkpoint_dir.exists():
            _remove_partial(checkpoint_dir)
        manifest = save_checkpoint(
            model.cpu(), model.config, checkpoint_dir, parent=parent, metadata=meta
        )
        metrics["checkpoint_id"] = manifest.checkpoint_id
        write_json(metrics_path, metrics)
        logger.info("run %s wrote checkpoint %s", spec.run_id, manifest.checkpoint_id)
    ctx.barrier()
    return 0


def _base_family(spec: JobSpec) -> str:
    """The model family the job trains: the base checkpoint's (``tiny`` without one)."""
    if spec.base_checkpoint is None or not spec.base_checkpoint.is_dir():
        family = spec.raw.get("family", "tiny")
        if family == "hf":
            raise JobError("hf training needs a base checkpoint: set 'base_checkpoint'")
        return "tiny"
    try:
        return read_manifest(spec.base_checkpoint).family
    except CheckpointError as exc:
        raise JobError(f"base checkpoint rejected: {exc}") from None


def _run_hf(
    spec: JobSpec,
    algorithm: str,
    env: Environment,
    tasks: list[TaskSpec],
    config: TrainerConfig,
    checkpoint_dir: Path,
    metrics_path: Path,
) -> int:
    # Imported here: the hf family needs transformers and peft, the tiny family does not.
    from services.training.hf.job import run_hf_train

    if checkpoint_dir.exists():
        _remove_partial(checkpoint_dir)
    metrics = run_hf_train(spec, algorithm, env, tasks, config)
    if "checkpoint_id" in metrics:  # rank 0 wrote the checkpoint
        metrics.update(
            run_id=spec.run_id,
            kind="train",
            algorithm=algorithm,
            environment=env.name,
            tasks=len(tasks),
            schema="ratchet.metrics/v1",
        )
        total = metrics["train_tokens"] + metrics["rollout_tokens"]
        metrics["tokens_per_s"] = round(total / metrics["wall_s"], 1) if metrics["wall_s"] else 0.0
        write_json(metrics_path, metrics)
        logger.info("run %s wrote hf checkpoint %s", spec.run_id, metrics["checkpoint_id"])
    return 0


def _environment(name: str) -> Environment:
    try:
        return get_environment(name)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def _dataset(spec: JobSpec) -> list[TaskSpec]:
    tasks = read_job_dataset(spec)
    foreign = {t.environment for t in tasks} - {spec.environment}
    if foreign:
        raise JobError(
            f"dataset has tasks of environment(s) {sorted(foreign)}, job is {spec.environment}"
        )
    return tasks


def _initial_model(spec: JobSpec, algorithm: str, model_hyper: Any) -> tuple[GPT, str | None]:
    if spec.base_checkpoint is None:
        if algorithm == "grpo":
            raise JobError(
                "grpo needs a base checkpoint: set 'base_checkpoint' or RATCHET_BASE_CHECKPOINT"
            )
        try:
            config = GPTConfig(**(model_hyper or {}))
        except (TypeError, ValueError) as exc:
            raise JobError(f"invalid hyperparameters.model: {exc}") from None
        torch.manual_seed(spec.seed)
        return GPT(config), None
    if not spec.base_checkpoint.is_dir():
        raise JobError(f"base checkpoint {spec.base_checkpoint} does not exist")
    try:
        policy = TinyModel.load(spec.base_checkpoint, device="cpu")
    except CheckpointError as exc:
        raise JobError(f"base checkpoint rejected: {exc}") from None
    return policy.model, policy.checkpoint_id


def _train_grpo(
    spec: JobSpec,
    env: Environment,
    tasks: list[TaskSpec],
    model: GPT,
    parent: str | None,
    config: GRPOConfig,
    ctx: DistContext,
) -> dict[str, Any]:
    result = train_grpo(
        model, env, tasks, config, ctx=ctx, state_dir=spec.output_dir / "state", parent=parent
    )
    return {
        **result.counters.metrics(),
        "resumed_from_step": result.resumed_from_step,
        "final_reward": result.final_reward,
        "final_pass_rate": result.final_pass_rate,
        "hyperparameters": config.to_dict(),
    }


def _train_sft(
    spec: JobSpec,
    env: Environment,
    tasks: list[TaskSpec],
    model: GPT,
    config: SFTConfig,
    augment: float,
    ctx: DistContext,
) -> dict[str, Any]:
    try:
        episodes = env.demonstrations(tasks, seed=config.seed, augment_fraction=float(augment))
        sequences = demonstration_sequences(
            episodes, ByteTokenizer(), max_seq_len=model.config.max_seq_len
        )
    except (NotImplementedError, ValueError) as exc:
        raise JobError(f"cannot build demonstrations: {exc}") from None
    result = train_sft(model, sequences, config, ctx=ctx)
    return {
        "steps": result.steps_done,
        "train_tokens": result.train_tokens,
        "rollout_tokens": 0,
        "rollout_tokens_per_s": 0.0,
        "train_tokens_per_s": result.train_tokens_per_s,
        "filtered_zero_variance_groups": 0,
        "final_loss": result.final_loss,
        "final_reward": None,
        "demonstrations": len(sequences),
        "hyperparameters": {**config.to_dict(), "augment_fraction": float(augment)},
    }


def _remove_partial(checkpoint_dir: Path) -> None:
    """A checkpoint dir left by a killed run (no metrics.json yet) is rewritten from scratch."""
    shutil.rmtree(checkpoint_dir)


def main() -> None:
    raise SystemExit(train_job_main(sys.argv[1:]))


if __name__ == "__main__":
    main()

"""The train job for hf checkpoints: what ``ratchet job train`` runs when the base is ``hf``.

Same contract as the tiny family's job (:mod:`services.training.job`): ``algorithm`` is
``sft`` or ``grpo``, the base checkpoint is the champion (required: an hf model is never
trained from scratch here), outputs are ``<output_dir>/checkpoint/`` (a LoRA adapter on
the champion's full base, or a full model with ``"lora": false``) and
``<output_dir>/metrics.json``. ``base_model`` in the spec (or ``RATCHET_BASE_MODEL``) is
the directory of an adapter champion's base when it does not lie beside the adapter in
the checkpoint store.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from services.environments.base import Environment, TaskSpec
from services.environments.chat import as_chat_environment
from services.training.checkpoint import CheckpointError
from services.training.config import HFGRPOConfig, HFSFTConfig, TrainerConfig
from services.training.distributed import DistContext, init_job_distributed
from services.training.hf.checkpoint import (
    load_hf_checkpoint,
    save_hf_checkpoint,
    save_lora_adapter,
)
from services.training.hf.model import HFModel
from services.training.hf.train import (
    LoRAOptions,
    demonstration_sequences,
    prepare_trainable,
    run_metrics,
    train_grpo_hf,
    train_sft_hf,
)
from services.training.jobspec import EXIT_FAILED, JobError, JobSpec
from services.training.optim import TrainingDiverged

logger = logging.getLogger("services.training.hf.job")


def run_hf_train(
    spec: JobSpec,
    algorithm: str,
    env: Environment,
    tasks: list[TaskSpec],
    config: TrainerConfig,
) -> dict[str, Any]:
    """Train, save the checkpoint (rank 0) and return the metrics; raises JobError."""
    try:
        chat_env = as_chat_environment(env)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if spec.base_checkpoint is None:
        raise JobError("hf training needs a base checkpoint (the champion)")
    declared = spec.raw.get("family", "hf")
    if declared != "hf":
        raise JobError(f"spec 'family' is {declared!r} but the base checkpoint is an hf model")
    if not isinstance(config, HFGRPOConfig | HFSFTConfig):
        raise JobError(f"{type(config).__name__} is not an hf trainer's config")
    ctx = init_job_distributed(spec.device)
    torch.manual_seed(spec.seed)
    loaded = _load_base(spec, ctx, config)
    try:
        model = prepare_trainable(loaded, config)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    model.to(ctx.device)
    tokenizer = loaded.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    started = time.monotonic()
    try:
        if isinstance(config, HFGRPOConfig):
            result = train_grpo_hf(model, tokenizer, chat_env, tasks, config, ctx=ctx)
        else:
            policy = HFModel(model, tokenizer, device=ctx.device)
            try:
                sequences = demonstration_sequences(
                    chat_env,
                    tasks,
                    policy,
                    recovery_fraction=config.recovery_fraction,
                    seed=config.seed,
                )
            except (NotImplementedError, ValueError) as exc:
                raise JobError(f"cannot build demonstrations: {exc}") from None
            result = train_sft_hf(
                model, sequences, config, pad_id=int(tokenizer.pad_token_id), ctx=ctx
            )
    except TrainingDiverged as exc:
        raise JobError(str(exc), exit_code=EXIT_FAILED) from None
    metrics = run_metrics(result)
    metrics["wall_s"] = round(time.monotonic() - started, 3)
    metrics["hyperparameters"] = config.to_dict()
    metrics["family"] = "hf"
    metrics["device"] = str(ctx.device)
    metrics["world_size"] = ctx.world_size
    parent = loaded.manifest.checkpoint_id
    if ctx.is_main:
        out = spec.output_dir / "checkpoint"
        meta = {"algorithm": algorithm, "run_id": spec.run_id, "steps": result.steps_done}
        model.cpu()
        if config.lora:
            base = loaded.base_manifest or loaded.manifest
            manifest = save_lora_adapter(model, out, base=base, parent=parent, metadata=meta)
        else:
            manifest = save_hf_checkpoint(model, tokenizer, out, parent=parent, metadata=meta)
        metrics["checkpoint_id"] = manifest.checkpoint_id
    metrics["parent_checkpoint_id"] = parent
    _finish(ctx)
    return metrics


def _load_base(spec: JobSpec, ctx: DistContext, options: LoRAOptions) -> Any:
    assert spec.base_checkpoint is not None
    dtype = torch.bfloat16 if ctx.device.type == "cuda" and options.lora else torch.float32
    try:
        return load_hf_checkpoint(
            spec.base_checkpoint,
            device="cpu",
            dtype=dtype,
            base_dir=spec.base_model,
            trainable_adapter=options.lora,
        )
    except CheckpointError as exc:
        raise JobError(f"base checkpoint rejected: {exc}") from None


def _finish(ctx: DistContext) -> None:
    ctx.barrier()

"""Supervised fine-tuning on demonstrations, for every model family: how a champion is made.

The loss is token-level cross-entropy on the tokens the model produces in a demonstration
(its turns and their end-of-turn token), never on the prompt, the system text or the tool
results, summed over the global batch and divided by its target-token count. Batches are
drawn with replacement by a generator seeded with (seed, step), so a run is a pure function
of its inputs; each rank trains its share of the draw in micro-batches of ``micro_batch``
and gradients are summed over ranks (a sharded model's rank with fewer micro-batches runs
idle passes, as its backward is a collective).

Written once over :class:`services.training.family.FamilyModel`: the family turns the
environment's solved episodes into token sequences (tiny: text transcripts, with
``augment_fraction`` drifted tool names; hf: chat-template renders, with
``recovery_fraction`` slips first) and scores a packed batch; the loop is here. AdamW
decays matrices only, for every family (the hf trainer this replaces decayed norms too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from services.environments.base import Environment, TaskSpec
from services.inference.utilisation import Work, sequence_work, training_figures
from services.training.checkpoint import Manifest, read_manifest
from services.training.config import SFTConfig
from services.training.counters import RunCounters
from services.training.distributed import DistContext, init_distributed, is_sharded
from services.training.family import (
    DemonstrationOptions,
    FamilyModel,
    TokenSequence,
    collate,
    family_for,
    idle_passes,
)
from services.training.optim import clip_and_check, make_optimizer, schedule_lr
from services.training.phases import PhaseClock
from services.training.rng import derive_seed
from services.training.tiny.model import GPTConfig

logger = logging.getLogger(__name__)


def sft_batch(
    sequences: Sequence[TokenSequence],
    step: int,
    *,
    seed: int,
    batch_size: int,
    ctx: DistContext,
    weights: Sequence[float] | None = None,
) -> tuple[float, list[TokenSequence]]:
    """Step ``step``'s draw of demonstrations: its target-token count and this rank's share.

    Every rank draws the same batch (seeded by step, not rank), so the count normalizes the
    loss over the whole batch and the shards add up to it; the share comes sorted by its
    tokens. ``weights`` (one per sequence, rft's task weights) draw in proportion to weight;
    None draws uniformly.
    """
    generator = torch.Generator().manual_seed(derive_seed(seed, step))
    if weights is None:
        batch = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
    else:
        probabilities = torch.tensor(weights, dtype=torch.float64)
        batch = torch.multinomial(probabilities, batch_size, True, generator=generator).tolist()
    targets = float(sum(sum(sequences[i][1][1:]) for i in batch))
    # Sorted by their tokens, a micro-batch holds rows that share a prefix (the same system
    # text and tool list), which its pass computes once; the step's gradient is the same sum.
    local = sorted((sequences[batch[j]] for j in ctx.shard(len(batch))), key=lambda s: s[0])
    return targets, local


def train_sft(
    model: FamilyModel,
    sequences: Sequence[TokenSequence],
    config: SFTConfig,
    *,
    ctx: DistContext,
    weights: Sequence[float] | None = None,
) -> RunCounters:
    """Train ``model``'s trainable weights on ``sequences`` for ``config.steps`` steps:
    each a :func:`sft_batch` draw (by ``weights`` if given), forward and backward in
    micro-batches, gradients summed over ranks, clipped and checked
    (:func:`clip_and_check`), one update."""
    if not sequences:
        raise ValueError("SFT needs at least one demonstration")
    model.train()
    params = [p for _, p in model.trainable_parameters()]
    ctx.broadcast_parameters(params)
    optimizer = make_optimizer(params, lr=config.lr, weight_decay=config.weight_decay)
    result = RunCounters()
    clock = PhaseClock(model.device, result.phase_s)
    work, passes = Work(), 0  # what the passes needed, for the training-pass MFU
    started = time.monotonic()
    with clock.phase("update"):
        for step in range(config.steps):
            targets, local = sft_batch(
                sequences,
                step,
                seed=config.seed,
                batch_size=config.batch_size,
                ctx=ctx,
                weights=weights,
            )
            lr = schedule_lr(optimizer, step, config)
            optimizer.zero_grad(set_to_none=True)
            local_loss = 0.0
            starts = range(0, len(local), config.micro_batch)
            # a sharded model's passes are collectives: as many on every rank as the busiest
            # rank's (asked before the first pass, which is a collective too)
            idle = ctx.most(len(starts)) - len(starts) if is_sharded(model) else 0
            for begin in starts:
                micro = local[begin : begin + config.micro_batch]
                batch = collate(micro, pad_id=model.pad_id, device=model.device)
                logp = model.logprobs(batch)  # (n, T-1)
                loss = -(logp * batch.target).sum() / max(1.0, targets)
                loss.backward()
                local_loss += float(loss.detach())
                result.train_tokens += batch.tokens
                work, passes = work + sequence_work(micro), passes + 1
            idle_passes(model, idle, backward=True)
            ctx.all_reduce_grads(params)
            clip_and_check(params, max_norm=config.grad_clip, step=step, lr=lr)
            optimizer.step()
            result.final_loss = ctx.all_reduce_sum([local_loss])[0]
            result.history.append({"step": step + 1, "loss": result.final_loss})
            if ctx.is_main and config.log_every and (step + 1) % config.log_every == 0:
                logger.info("sft step %d/%d loss %.4f", step + 1, config.steps, result.final_loss)
    result.steps_done = config.steps
    result.train_s = time.monotonic() - started
    result.utilisation.add("train", training_figures(model, work, passes, result.train_s))
    result.train_tokens = int(ctx.all_reduce_sum([float(result.train_tokens)])[0])
    model.train(False)
    return result


def make_champion(
    env: Environment,
    out_dir: Path | str,
    *,
    tasks: Sequence[TaskSpec],
    model_config: GPTConfig | None = None,
    config: SFTConfig | None = None,
    augment_fraction: float = 0.0,
    device: str = "auto",
    ctx: DistContext | None = None,
) -> tuple[Manifest, RunCounters]:
    """Train a fresh tiny model on demonstrations of ``tasks`` and save it as a checkpoint.

    ``model_config`` None is :class:`GPTConfig`'s defaults; ``augment_fraction`` is passed
    to :meth:`Environment.demonstrations` (toolcalc: the share of demonstrations that call
    tools by their announced new names).
    """
    config = config or SFTConfig()
    ctx = ctx or init_distributed(device)
    shape = (model_config or GPTConfig()).to_dict()
    shape.pop("architecture")
    model = family_for("tiny").create(shape, seed=config.seed, device=ctx.device)
    options = DemonstrationOptions(seed=config.seed, augment_fraction=augment_fraction)
    sequences = model.demonstrations(env, tasks, options)
    result = train_sft(model, sequences, config, ctx=ctx)
    metadata: dict[str, object] = {
        "algorithm": "sft",
        "steps": result.steps_done,
        "environment": env.name,
        "demonstrations": len(sequences),
        "augment_fraction": augment_fraction,
    }
    if ctx.is_main:
        model.save(Path(out_dir), parent=None, metadata=metadata)
    ctx.barrier()
    return read_manifest(Path(out_dir)), result

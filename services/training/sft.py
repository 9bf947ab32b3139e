"""Supervised fine-tuning on demonstrations: how the first champion is made.

The loss is token-level cross-entropy on the tokens the agent produces in a demonstration
(its turns and their closing newlines), never on the prompt or the tool results, summed
over the global batch and divided by its token count. Batches are drawn with replacement
by a generator seeded with (seed, step), so a run is a pure function of its inputs. The
loop (:func:`sft_steps`) is the hf family's too; only the forward pass of a chunk differs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from services.environments.base import Environment, Episode, TaskSpec
from services.training.checkpoint import Manifest, read_manifest, save_checkpoint
from services.training.config import HFSFTConfig, SFTConfig
from services.training.counters import RunCounters
from services.training.device import autocast
from services.training.distributed import DistContext, init_distributed
from services.training.model import GPT, GPTConfig, token_logprobs
from services.training.optim import clip_and_check, make_optimizer, schedule_lr
from services.training.rng import derive_seed
from services.training.rollout import collate, episode_tokens
from services.training.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

Sequences = list[tuple[list[int], list[bool]]]


def demonstration_sequences(
    episodes: Sequence[Episode], tokenizer: ByteTokenizer, *, max_seq_len: int
) -> Sequences:
    """Token ids + agent-token masks of demonstrations; one longer than the context is an error."""
    sequences = []
    for episode in episodes:
        ids, mask = episode_tokens(episode, tokenizer)
        if len(ids) > max_seq_len:
            raise ValueError(
                f"demonstration of task {episode.task_id[:12]} has {len(ids)} tokens, "
                f"more than max_seq_len={max_seq_len}"
            )
        sequences.append((ids, mask))
    return sequences


def sft_loss(model: GPT, ids: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Sum of target-token NLL over ``mask`` (N, T-1), divided by ``normalizer``."""
    logp = token_logprobs(model, ids)  # (N, T-1)
    return -(logp * mask).sum() / normalizer


def sft_batch(
    sequences: Sequences, step: int, *, seed: int, batch_size: int, ctx: DistContext
) -> tuple[float, Sequences]:
    """Step ``step``'s draw of demonstrations: its target-token count and this rank's share.

    Every rank draws the same batch (seeded by step, not rank), so the count normalizes the
    loss over the whole batch and the shards add up to it; the tiny and hf trainers share it.
    """
    generator = torch.Generator().manual_seed(derive_seed(seed, step))
    batch = torch.randint(len(sequences), (batch_size,), generator=generator).tolist()
    targets = float(sum(sum(sequences[i][1][1:]) for i in batch))
    local = [sequences[batch[j]] for j in ctx.shard(len(batch))]
    return targets, local


# A family's forward pass over one chunk of a step's local demonstrations, given the global
# batch's target-token count: the chunk's loss (already divided by that count) and its tokens.
ChunkLoss = Callable[[Sequences, float], tuple[torch.Tensor, int]]


def sft_steps(
    sequences: Sequences,
    config: SFTConfig | HFSFTConfig,
    *,
    ctx: DistContext,
    optimizer: torch.optim.Optimizer,
    trainable: nn.Module,
    chunk_loss: ChunkLoss,
    micro_batch: int | None,
    log: logging.Logger,
) -> RunCounters:
    """The SFT loop of both families: ``config.steps`` steps, each a :func:`sft_batch` draw,
    forward and backward in chunks of ``micro_batch`` (None: this rank's share at once),
    gradients summed over ranks, clipped and checked (:func:`clip_and_check`), one update."""
    if not sequences:
        raise ValueError("SFT needs at least one demonstration")
    result = RunCounters()
    started = time.monotonic()
    for step in range(config.steps):
        targets, local = sft_batch(
            sequences, step, seed=config.seed, batch_size=config.batch_size, ctx=ctx
        )
        lr = schedule_lr(optimizer, step, config)
        optimizer.zero_grad(set_to_none=True)
        local_loss = 0.0
        size = micro_batch or max(len(local), 1)
        for begin in range(0, len(local), size):
            loss, tokens = chunk_loss(local[begin : begin + size], max(1.0, targets))
            loss.backward()
            local_loss += float(loss.detach())
            result.train_tokens += tokens
        ctx.all_reduce_grads(trainable)
        clip_and_check(trainable, max_norm=config.grad_clip, step=step, lr=lr)
        optimizer.step()
        result.final_loss = ctx.all_reduce_sum([local_loss])[0]
        result.history.append({"step": step + 1, "loss": result.final_loss})
        if ctx.is_main and config.log_every and (step + 1) % config.log_every == 0:
            log.info("sft step %d/%d loss %.4f", step + 1, config.steps, result.final_loss)
    result.steps_done = config.steps
    result.train_s = time.monotonic() - started
    result.train_tokens = int(ctx.all_reduce_sum([float(result.train_tokens)])[0])
    return result


def train_sft(
    model: GPT,
    sequences: Sequences,
    config: SFTConfig,
    *,
    ctx: DistContext,
) -> RunCounters:
    """Train ``model`` in place on ``sequences`` for ``config.steps`` steps."""
    device = ctx.device
    model.to(device).train()
    ctx.broadcast_model(model)

    def chunk_loss(chunk: Sequences, normalizer: float) -> tuple[torch.Tensor, int]:
        ids, mask = collate(chunk, device=device)
        with autocast(device):
            loss = sft_loss(model, ids, mask, normalizer)
        return loss, sum(len(seq_ids) for seq_ids, _ in chunk)

    return sft_steps(
        sequences,
        config,
        ctx=ctx,
        optimizer=make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay),
        trainable=model,
        chunk_loss=chunk_loss,
        micro_batch=None,
        log=logger,
    )


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
    """Train a fresh policy on demonstrations of ``tasks`` and save it as a checkpoint.

    ``augment_fraction`` is passed to :meth:`Environment.demonstrations` (toolcalc: the
    share of demonstrations that call tools by their announced new names).
    """
    model_config = model_config or GPTConfig()
    config = config or SFTConfig()
    ctx = ctx or init_distributed(device)
    torch.manual_seed(config.seed)
    model = GPT(model_config)
    episodes = env.demonstrations(tasks, seed=config.seed, augment_fraction=augment_fraction)
    sequences = demonstration_sequences(
        episodes, ByteTokenizer(), max_seq_len=model_config.max_seq_len
    )
    result = train_sft(model, sequences, config, ctx=ctx)
    metadata = {
        "algorithm": "sft",
        "steps": result.steps_done,
        "environment": env.name,
        "demonstrations": len(sequences),
        "augment_fraction": augment_fraction,
    }
    if ctx.is_main:
        save_checkpoint(model.cpu(), model_config, out_dir, metadata=metadata)
    ctx.barrier()
    return read_manifest(out_dir), result

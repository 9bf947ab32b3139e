"""DPO on success/failure pairs of one task, the starting weights as the frozen reference.

Direct Preference Optimization (Rafailov et al., 2023), as TRL's ``DPOTrainer`` computes
its default sigmoid loss: for a pair (chosen ``c``, rejected ``r``) with policy and
reference log-likelihoods ``logπ`` and ``logπ_ref``,

    loss = -log sigmoid(β · ((logπ(c) - logπ_ref(c)) - (logπ(r) - logπ_ref(r))))

averaged over the step's pairs. The pairs come from the model itself: sample
``samples_per_task`` episodes of every task as rft does
(:func:`services.training.rft.sample_episodes`); a verified success and a failure of the
same task are a pair (at most ``pairs_per_task`` per task), and so are the stored successes
and failures of the task from earlier runs (a train job's ``demonstrations.jsonl``). The
reference is the champion, the weights the job started from: its log-likelihoods are
computed once, before the first update, so no second model is kept.

Multi-turn episodes: an episode's log-likelihood is the sum over **the model's own tokens
only** (its turns: the target mask of :attr:`TokenEpisode.sequences`), never the prompt or
the tool results, so two episodes that differ in what a tool said are compared on what the
model said.

Pairs are drawn each step with replacement, in proportion to ``task weight / pairs of that
task`` (as rft weighs its successes), seeded by (seed, step); a micro-batch holds whole
pairs, since the loss of a pair is not a sum over its tokens. Ranks split a step's pairs and
sum their gradients, so the update is the same on any world size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.environments.base import Environment, TaskSpec
from services.training.config import DPOConfig
from services.training.counters import RunCounters
from services.training.distributed import DistContext
from services.training.episode_file import EpisodeRecord
from services.training.family import FamilyModel, TokenEpisode, TokenSequence, collate
from services.training.grpo import task_weights
from services.training.keep import EpisodeKeeper
from services.training.optim import clip_and_check, make_optimizer, schedule_lr
from services.training.rft import SampledTasks, StoredEpisodes, sample_episodes, stored_episodes
from services.training.rng import derive_seed

logger = logging.getLogger(__name__)

_DRAW_STREAM = 0xD90  # the per-step pair draw


@dataclass(frozen=True)
class Pair:
    """A success and a failure of one task, as training sequences (model turns are targets)."""

    chosen: list[TokenSequence]
    rejected: list[TokenSequence]


def episode_logps(model: FamilyModel, episodes: Sequence[Sequence[TokenSequence]]) -> torch.Tensor:
    """Each episode's log-likelihood under the current weights, summed over its target
    tokens (the model's turns) across all its sequences: (E,), with gradients."""
    flat = [sequence for episode in episodes for sequence in episode]
    owner = torch.tensor(
        [index for index, episode in enumerate(episodes) for _ in episode],
        dtype=torch.long,
        device=model.device,
    )  # (S,)
    batch = collate(flat, pad_id=model.pad_id, device=model.device)
    logp = model.logprobs(batch)  # (S, T-1)
    per_sequence = (logp * batch.target).sum(dim=1)  # (S,)
    totals = torch.zeros(len(episodes), dtype=per_sequence.dtype, device=model.device)
    return totals.index_add(0, owner, per_sequence)  # (E,)


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss (P,) and the implicit reward margin (P,), from (P,) sums."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))  # (P,)
    return -torch.nn.functional.logsigmoid(margin), margin.detach()


def pair_logps(model: FamilyModel, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected log-likelihoods of ``pairs`` in one forward pass: (P,), (P,)."""
    totals = episode_logps(model, [p.chosen for p in pairs] + [p.rejected for p in pairs])
    return totals[: len(pairs)], totals[len(pairs) :]


def pairs_loss(
    model: FamilyModel,
    pairs: Sequence[Pair],
    reference: torch.Tensor,
    *,
    beta: float,
    normalizer: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DPO loss of ``pairs`` summed and divided by ``normalizer`` (the step's pairs),
    with gradients, and each pair's margin (P,); ``reference`` is their (P, 2) reference
    (chosen, rejected) log-likelihoods."""
    chosen, rejected = pair_logps(model, pairs)  # (P,), (P,)
    ref = reference.to(device=chosen.device, dtype=chosen.dtype)  # (P, 2)
    losses, margins = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], beta=beta)
    return losses.sum() / normalizer, margins


def make_pairs(
    sampled: SampledTasks,
    tasks: Sequence[TaskSpec],
    *,
    pairs_per_task: int,
    stored: tuple[StoredEpisodes, StoredEpisodes] | None = None,
) -> tuple[list[Pair], list[float]]:
    """Success/failure pairs of each task and each pair's draw weight: this run's samples
    first (in sampling order), then ``stored`` (successes, failures) of earlier runs of the
    same task, so a success the probe found pairs with a failure sampled now."""
    weights = task_weights(tasks) or [1.0] * len(tasks)
    empty: StoredEpisodes = [[] for _ in tasks]
    kept_successes, kept_failures = stored or (empty, empty)
    pairs: list[Pair] = []
    draw: list[float] = []
    for i, (weight, group) in enumerate(zip(weights, sampled.groups, strict=True)):
        successes = [_sequences(e) for e in group if e.reward.passed] + kept_successes[i]
        failures = [_sequences(e) for e in group if not e.reward.passed] + kept_failures[i]
        count = min(len(successes), len(failures), pairs_per_task)
        for chosen, rejected in zip(successes[:count], failures[:count], strict=True):
            pairs.append(Pair(chosen=chosen, rejected=rejected))
            draw.append(weight / count)
    return pairs, draw


def _sequences(episode: TokenEpisode) -> list[TokenSequence]:
    return [(list(ids), list(mask)) for ids, mask in episode.sequences]


@dataclass
class DPOResult:
    """What a dpo run saw and did."""

    counters: RunCounters
    successes: int = 0
    pairs: int = 0
    tasks_paired: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        """The figures a dpo job writes to metrics.json."""
        last = self.counters.history[-1] if self.counters.history else None
        return {
            **self.counters.metrics(),
            "successes": self.successes,
            "pairs": self.pairs,
            "tasks_paired": self.tasks_paired,
            "final_loss": self.counters.final_loss,
            "final_pass_rate": self.successes / max(1, self.counters.episodes),
            "final_reward_accuracy": last["reward_accuracy"] if last else None,
            "trained": self.counters.steps_done > 0,
        }


def train_dpo(
    model: FamilyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    config: DPOConfig,
    *,
    ctx: DistContext,
    stored: Sequence[EpisodeRecord] = (),
    keeper: EpisodeKeeper | None = None,
) -> DPOResult:
    """Sample pairs from the starting weights, then ``config.steps`` DPO updates, in place.
    ``stored`` (earlier runs' verified episodes of these tasks) pair with this run's samples
    and with each other; ``keeper`` is handed every episode sampled. No pair (no task with
    both a success and a failure): nothing is trained, and the result says so."""
    if not tasks:
        raise ValueError("DPO needs at least one task")
    result = DPOResult(counters=RunCounters())
    model.train(False)
    sampled = sample_episodes(model, env, tasks, config, seed=config.seed)
    if keeper is not None:
        keeper.add(episode for group in sampled.groups for episode in group)
    earlier = (
        stored_episodes(tasks, stored, passed=True, family=model.family),
        stored_episodes(tasks, stored, passed=False, family=model.family),
    )
    pairs, weights = make_pairs(
        sampled, tasks, pairs_per_task=config.pairs_per_task, stored=earlier
    )
    counters = result.counters
    counters.add_sampling(sampled.generated_tokens, sampled.wall_s, sampled.episodes)
    counters.groups = len(sampled.groups)
    result.successes = sampled.successes
    result.pairs = len(pairs)
    result.tasks_paired = _tasks_paired(sampled, earlier)
    if not pairs or config.steps == 0:
        if ctx.is_main:
            logger.warning(
                "dpo: %d pairs from %d episodes (%d passed); the model is unchanged",
                len(pairs),
                sampled.episodes,
                sampled.successes,
            )
        return result
    scored = time.monotonic()
    reference = reference_logps(model, pairs, config.micro_batch)  # (P, 2), the champion's
    counters.add_phases({"scoring": time.monotonic() - scored})
    params = [p for _, p in model.trainable_parameters()]
    ctx.broadcast_parameters(params)
    optimizer = make_optimizer(params, lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    started = time.monotonic()
    for step in range(config.steps):
        stats = _dpo_step(step, model, pairs, weights, reference, config, optimizer, ctx)
        counters.train_tokens += int(stats.pop("local_tokens"))
        counters.history.append(stats)
        counters.final_loss = stats["loss"]
        counters.steps_done = step + 1
        if ctx.is_main and config.log_every and (step + 1) % config.log_every == 0:
            logger.info(
                "dpo step %d/%d loss %.4f reward accuracy %.3f margin %.4f",
                step + 1,
                config.steps,
                stats["loss"],
                stats["reward_accuracy"],
                stats["margin"],
            )
    counters.train_s = time.monotonic() - started
    counters.add_phases({"update": counters.train_s})
    counters.train_tokens = int(ctx.all_reduce_sum([float(counters.train_tokens)])[0])
    model.train(False)
    return result


def _tasks_paired(sampled: SampledTasks, stored: tuple[StoredEpisodes, StoredEpisodes]) -> int:
    """Tasks with both a success and a failure among their samples and stored episodes."""
    kept_successes, kept_failures = stored
    return sum(
        (any(e.reward.passed for e in group) or bool(kept_successes[i]))
        and (not all(e.reward.passed for e in group) or bool(kept_failures[i]))
        for i, group in enumerate(sampled.groups)
    )


@torch.no_grad()
def reference_logps(model: FamilyModel, pairs: Sequence[Pair], micro_batch: int) -> torch.Tensor:
    """The starting weights' (chosen, rejected) log-likelihood of every pair: (P, 2)."""
    rows = []
    for begin in range(0, len(pairs), micro_batch):
        chosen, rejected = pair_logps(model, pairs[begin : begin + micro_batch])
        rows.append(torch.stack([chosen, rejected], dim=1))  # (p, 2)
    return torch.cat(rows).detach()


def _dpo_step(
    step: int,
    model: FamilyModel,
    pairs: Sequence[Pair],
    weights: Sequence[float],
    reference: torch.Tensor,
    config: DPOConfig,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
) -> dict[str, float]:
    params = [p for _, p in model.trainable_parameters()]  # the optimizer's, in its order
    generator = torch.Generator().manual_seed(derive_seed(config.seed, _DRAW_STREAM, step))
    drawn = torch.multinomial(
        torch.tensor(weights, dtype=torch.float64), config.batch_size, True, generator=generator
    ).tolist()
    local = [drawn[j] for j in ctx.shard(len(drawn))]
    lr = schedule_lr(optimizer, step, config)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = correct = margin_sum = 0.0
    tokens = sum(
        len(ids) for i in local for pair in [pairs[i]] for ids, _ in pair.chosen + pair.rejected
    )
    for begin in range(0, len(local), config.micro_batch):
        indices = local[begin : begin + config.micro_batch]
        loss, margins = pairs_loss(
            model,
            [pairs[i] for i in indices],
            reference[indices],
            beta=config.beta,
            normalizer=config.batch_size,
        )
        loss.backward()
        loss_sum += float(loss.detach())
        correct += float((margins > 0).sum())
        margin_sum += float(margins.sum())
    ctx.all_reduce_grads(params)
    clip_and_check(params, max_norm=config.grad_clip, step=step, lr=lr)
    optimizer.step()
    loss_total, correct_total, margin_total = ctx.all_reduce_sum([loss_sum, correct, margin_sum])
    return {
        "step": float(step + 1),
        "loss": loss_total,
        "reward_accuracy": correct_total / config.batch_size,
        "margin": margin_total / config.batch_size,
        "local_tokens": float(tokens),  # this rank's; the run totals them over ranks at the end
    }

"""GRPO's adaptive sampling: more episodes for the tasks a step can still learn from.

A step first samples ``adaptive_probe`` episodes of each task, then splits the rest of its
episode budget (``group_size`` per task) by what the probe saw: none for a solved task,
a full share for one whose pass rate is strictly between 0 and 1, ``adaptive_unsolved_rate``
of a share for an unsolved one (its rare success is what RL needs). Split out of
:mod:`services.training.grpo`, which calls :func:`adaptive_rollouts` when
``adaptive_sampling`` is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.environments.base import Environment, TaskSpec
from services.training.config import GRPOConfig
from services.training.distributed import DistContext, is_sharded
from services.training.family import FamilyModel, Rollouts, TokenEpisode
from services.training.rng import derive_seed


def adaptive_allocation(
    passes: Sequence[float], *, probe: int, budget: int, unsolved_rate: float
) -> list[int]:
    """Episodes beyond the probe for each task of a step, within ``budget`` in all.

    A task whose ``probe`` episodes all passed gets none (it has nothing left to teach); one
    whose pass rate is strictly between 0 and 1 gets a share of weight 1; an unsolved one a
    share of weight ``unsolved_rate`` (its rare success is what the search is for). The
    ``budget - probe x tasks`` episodes left are split in proportion to weight (largest
    remainders, ties to the earlier task); with no weight, nothing more is sampled.
    """
    weights = [0.0 if p >= probe else (unsolved_rate if p <= 0 else 1.0) for p in passes]
    left = budget - probe * len(passes)
    total = sum(weights)
    if left <= 0 or total <= 0:
        return [0] * len(passes)
    quotas = [left * w / total for w in weights]
    extra = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - extra[i]), i))
    for i in by_remainder[: left - sum(extra)]:
        extra[i] += 1
    return extra


def adaptive_rollouts(
    step: int,
    model: FamilyModel,
    env: Environment,
    step_tasks: Sequence[TaskSpec],
    config: GRPOConfig,
    ctx: DistContext,
) -> tuple[Rollouts, list[int]]:
    """This rank's episodes of the step, grouped by task (the group sizes beside them):
    ``adaptive_probe`` per task, then :func:`adaptive_allocation` of the step's budget. The
    probe's passes are summed over ranks, so every rank allocates the same global budget,
    and episode ``g`` of task ``j`` keeps its seed: a probe is the first episodes of a group."""
    local = ctx.shard(len(step_tasks))
    probe = config.adaptive_probe
    first = rollouts_of(
        step, model, env, step_tasks, [(j, g) for j in local for g in range(probe)], config
    )
    passes = [0.0] * len(step_tasks)
    for index, episode in enumerate(first.episodes):
        passes[local[index // probe]] += float(episode.reward.passed)
    extra = adaptive_allocation(
        ctx.all_reduce_sum(passes),
        probe=probe,
        budget=len(step_tasks) * config.group_size,
        unsolved_rate=config.adaptive_unsolved_rate,
    )
    wanted = [(j, g) for j in local for g in range(probe, probe + extra[j])]
    more = rollouts_of(step, model, env, step_tasks, wanted, config)
    episodes: list[TokenEpisode] = []
    extra_by_task: dict[int, list[TokenEpisode]] = {j: [] for j in local}
    for (j, _), episode in zip(wanted, more.episodes, strict=True):
        extra_by_task[j].append(episode)
    for position, j in enumerate(local):
        episodes.extend(first.episodes[position * probe : (position + 1) * probe])
        episodes.extend(extra_by_task[j])
    rollouts = Rollouts(
        episodes=episodes,
        generated_tokens=first.generated_tokens + more.generated_tokens,
        prompt_tokens=first.prompt_tokens + more.prompt_tokens,
        utilisation=first.utilisation,
    )
    rollouts.utilisation.merge(more.utilisation)
    return rollouts, [probe + extra[j] for j in local]


def rollouts_of(
    step: int,
    model: FamilyModel,
    env: Environment,
    step_tasks: Sequence[TaskSpec],
    wanted: Sequence[tuple[int, int]],
    config: GRPOConfig,
) -> Rollouts:
    """Episode ``g`` of step task ``j`` for each (j, g) of ``wanted``, seeded as always. A
    sharded model rolls out even with nothing wanted: its rollouts are collectives."""
    if not wanted and not is_sharded(model):
        return Rollouts(episodes=[], generated_tokens=0, prompt_tokens=0)
    return model.rollouts(
        env,
        [step_tasks[j] for j, _ in wanted],
        seeds=[derive_seed(config.seed, step, j, g) for j, g in wanted],
        max_turns=config.max_turns,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
    )

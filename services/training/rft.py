"""RFT: rejection-sampling fine-tuning on the verified successes, for every model family.

The line of STaR (Zelikman et al., 2022), RFT (Yuan et al., 2023) and ReST-EM (Singh et
al., 2023): sample ``samples_per_task`` episodes of every task from the current weights,
keep the ones the environment's verifier passed, and fine-tune on them with the SFT loss
(:func:`services.training.sft.train_sft`); with ``iterations`` > 1, sample again from the
improved weights and repeat. What is learned is only what the model already did right at
least once, which is why it suits a drift where a few samples in many find the new API.

Choices, each on purpose:

- **Successes are the exact sampled token ids** (:attr:`TokenEpisode.sequences`): only the
  model's own turns are targets; prompts and tool results are context.
- **Weights**: each success of a task weighs ``task weight / successes of that task``, so a
  task counts by its dedup weight (how often production hit it) however easy it was: a
  task solved 8 times in 8 does not crowd out one solved once in 8.
- **Stored successes** (``stored``: earlier runs' verified episodes of the same tasks, a
  train job's ``demonstrations.jsonl``) join every iteration's SFT set as successes of
  their task, weighed like sampled ones; only those of the model's family are used.
- **Replay** (``replay_fraction`` > 0 and replay tasks given: a dataset's replay split,
  tasks the champion handled): before the first iteration, an episode of each of at most
  ``replay_tasks`` of them is decoded greedily from the starting weights (or
  ``replay_samples`` a task at ``replay_temperature`` > 0) and the verified ones kept;
  every iteration's SFT draw gives them ``replay_fraction`` of its weight. Greedy because
  the behaviour to keep is the one the gate's regression suite checks and serving decodes:
  sampled at T=1, the bookshop's SmolLM2 champion's 28 and 32 replay episodes (two seeds)
  gave 1 and 3 training sequences, so half of each draw was one to three sequences (its
  14 greedy episodes on seed 0's replay tasks gave 2).
  Without replay the SFT set holds only the new behaviour and the model forgets what it did
  right before (measured on SmolLM2, docs/models.md run 5: v1 100% -> 72.5% while the
  drift recovered); replaying its own successes is self-distillation, on its own tokens,
  so it anchors without teaching anything new. Replay alone never trains: an iteration
  with no new success leaves the model as it was.
- **Enough successes** (``enough_successes`` > 0): a task with that many successes in a
  round is sampled no more in it. Once the model has the new behaviour most tasks pass
  most samples, and sampling them all ``samples_per_task`` times buys successes the SFT
  draw weighs down anyway (measured on SmolLM2, docs/models.md run 6: 666 successes of 54
  tasks in the second round, most of the run's time).
- **Unsolved tasks first**: each wave of a round samples the tasks with no success yet
  before the others, and the samples a task with enough successes leaves go to tasks still
  without one, up to ``unsolved_sample_factor`` x ``samples_per_task`` episodes each (the
  round never samples more than ``samples_per_task`` x tasks): a task's first success is
  what decides whether the SFT set teaches it at all, its fifth adds little.
- **Rare successes are said**: a round in which fewer than :data:`RARE_SUCCESS_RATE` of
  the episodes passed, or that solved fewer than :data:`RARE_SOLVED_TASKS` tasks, is
  flagged in the metrics (``rare_successes``, with a sentence) and the log: what is learned
  then rests on a handful of episodes, and another seed may find none (measured on SmolLM2,
  docs/models.md: 1 and 2 passing episodes in 1,024 gave 37.5 % and 100 % on the drifted
  set).
- **Zero successes** is a result, not an error: the iteration trains nothing, the model is
  left as it was, and the stats say so (``successes: 0``, ``trained: false``).
- **Seeds**: episode ``s`` of task ``i`` in iteration ``it`` samples with
  ``derive_seed(seed, 0x5F7, it, i, s)``; every rank samples every task (the SFT draw needs
  the whole success set on each rank), so a run is the same on any world size.

Written once over :class:`services.training.family.FamilyModel`; :func:`sample_episodes`
is also how :mod:`services.training.dpo` samples its pairs.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from services.environments.base import Environment, TaskSpec
from services.inference.utilisation import Utilisation
from services.training.config import RFTConfig
from services.training.counters import RunCounters
from services.training.distributed import DistContext
from services.training.episode_file import EpisodeRecord
from services.training.family import FamilyModel, TokenEpisode, TokenSequence
from services.training.grpo import task_weights
from services.training.keep import EpisodeKeeper
from services.training.rng import derive_seed
from services.training.sft import train_sft

logger = logging.getLogger(__name__)

# A round is flagged rare when fewer than this share of its episodes passed, or it solved
# fewer than RARE_SOLVED_TASKS tasks.
RARE_SUCCESS_RATE = 0.01
RARE_SOLVED_TASKS = 3
_SAMPLE_STREAM = 0x5F7  # keeps rft/dpo sampling seeds apart from GRPO's
_REPLAY_STREAM = 0x3E9  # and the replay's draw and samples apart from the iterations'


@dataclass(frozen=True)
class SampledTasks:
    """``samples_per_task`` episodes of each task, grouped by task index, and their cost."""

    groups: list[list[TokenEpisode]]
    generated_tokens: int
    wall_s: float
    utilisation: Utilisation = field(default_factory=Utilisation)

    @property
    def episodes(self) -> int:
        return sum(len(group) for group in self.groups)

    @property
    def successes(self) -> int:
        return sum(episode.reward.passed for group in self.groups for episode in group)


class SampleBudget:
    """Which task a round samples next: a round may sample ``per_task`` episodes of every
    task, and no more in all. Tasks are drawn in waves over their sample count (episode 0 of
    every task, then 1, ...), tasks with no success yet first in each wave. A task with
    ``enough`` successes is sampled no more (``enough`` 0: never), and the samples it leaves
    go to tasks with no success yet, up to ``most`` episodes each: where another episode can
    still turn a task from failed to solved, the one thing the SFT set needs of it."""

    def __init__(self, tasks: int, per_task: int, enough: int, most: int) -> None:
        self.per_task, self.enough, self.most = per_task, enough, max(most, per_task)
        self.count, self.passed = [0] * tasks, [0] * tasks
        self.left = self.owed = per_task * tasks  # the round's episodes; those owed to waves
        self._heap = [(0, 0, i) for i in range(tasks)]  # (count, solved, task)
        self._parked: list[int] = []  # unsolved at per_task, waiting for spare episodes

    def _closed(self, i: int) -> bool:
        return bool(self.enough) and self.passed[i] >= self.enough

    def next(self, in_flight: Mapping[int, int] | None = None) -> int | None:
        """The task of the next episode (its sample index is ``count[i] - 1`` after), or
        None when the round is spent or every open task is busy.

        ``in_flight`` (task: episodes drawn whose outcome is not known yet) makes a task busy
        once, were all of them to pass, it would have ``enough`` successes: so a caller that
        learns the outcomes only after a batch never overshoots ``enough``, and still puts
        several episodes of a task that needs several successes in one batch."""
        flying = in_flight or {}
        deferred: list[tuple[int, int, int]] = []
        try:
            while self._heap:
                count, solved, i = heapq.heappop(self._heap)
                if count != self.count[i] or solved != (self.passed[i] > 0) or self._closed(i):
                    continue  # a stale entry, or a task with enough successes
                if self.enough and self.passed[i] + flying.get(i, 0) >= self.enough:
                    deferred.append((count, solved, i))
                    continue
                if count < self.per_task:
                    self.owed -= 1
                elif solved or count >= self.most:
                    continue
                elif self.left - self.owed <= 0:
                    self._parked.append(i)
                    continue
                self.count[i] += 1
                self.left -= 1
                heapq.heappush(self._heap, (count + 1, solved, i))
                return i
            return None
        finally:
            for entry in deferred:
                heapq.heappush(self._heap, entry)

    def record(self, i: int, passed: bool) -> None:
        """An episode of task ``i`` came back."""
        if not passed:
            return
        self.passed[i] += 1
        if self.passed[i] == 1:
            heapq.heappush(self._heap, (self.count[i], 1, i))
        if self._closed(i) and self.passed[i] == self.enough:
            self.owed -= max(0, self.per_task - self.count[i])  # its samples are spare now
            for parked in self._parked:
                heapq.heappush(self._heap, (self.count[parked], 0, parked))
            self._parked.clear()


class _RoundFeed:
    """A round's episodes, drawn from its :class:`SampleBudget` as the rollout call's rows
    free, and filed by task as they end (which is when the budget learns their outcome)."""

    def __init__(
        self, budget: SampleBudget, tasks: Sequence[TaskSpec], seed: int, round_index: int
    ) -> None:
        self.budget, self.tasks, self.seed, self.round_index = budget, tasks, seed, round_index
        self.groups: list[list[TokenEpisode]] = [[] for _ in tasks]
        self.drawn: list[int] = []  # the task of the call's episode k
        self.in_flight: Counter[int] = Counter()

    def next_episode(self) -> tuple[TaskSpec, int] | None:
        i = self.budget.next(self.in_flight)
        if i is None:
            return None
        self.drawn.append(i)
        self.in_flight[i] += 1
        sample = self.budget.count[i] - 1
        return self.tasks[i], derive_seed(self.seed, _SAMPLE_STREAM, self.round_index, i, sample)

    def episode_ended(self, index: int, episode: TokenEpisode) -> None:
        i = self.drawn[index]
        self.in_flight[i] -= 1
        self.groups[i].append(episode)
        self.budget.record(i, episode.reward.passed)


class SamplingPlan(Protocol):
    """How a round samples (:class:`~services.training.config.SamplingOptions`, or the
    replay's :class:`ReplaySampling`)."""

    @property
    def samples_per_task(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def max_turns(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def rollout_batch(self) -> int: ...


@dataclass(frozen=True)
class ReplaySampling:
    """The replay's sampling: the rounds' turn and token budgets and rows, its own
    temperature (0: greedy) and samples a task."""

    samples_per_task: int
    temperature: float
    max_turns: int
    max_new_tokens: int
    rollout_batch: int


def sample_episodes(
    model: FamilyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    options: SamplingPlan,
    *,
    seed: int,
    round_index: int = 0,
    enough_successes: int = 0,
    most_per_task: int = 0,
) -> SampledTasks:
    """Up to ``options.samples_per_task`` verified episodes of every task under the current
    weights, in one rollout call that keeps ``options.rollout_batch`` episodes decoding: a
    row that frees takes the next episode the budget allows, so the round never waits on a
    batch's slowest episode before the next batch starts (each episode is seeded on its own,
    by task and sample index, so where it runs changes nothing).

    Episodes are drawn in waves over the sample index, tasks with no success yet first
    (:class:`SampleBudget`), as rows free, from the outcomes of the episodes ended so far:
    with ``enough_successes`` > 0 a task with that many successes gets no more (no more of
    its episodes run at once than it still needs successes, so none overshoots), and what it
    leaves of the round goes to tasks still without a success, up to ``most_per_task``
    episodes each. Without ``enough_successes`` every task gets exactly
    ``samples_per_task``."""
    budget = SampleBudget(len(tasks), options.samples_per_task, enough_successes, most_per_task)
    feed = _RoundFeed(budget, tasks, seed, round_index)
    started = time.monotonic()
    rollouts = model.rollouts(
        env,
        [],
        seeds=[],
        max_turns=options.max_turns,
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        max_rows=options.rollout_batch,
        feed=feed,
    )
    unfinished = len(feed.drawn) != len(rollouts.episodes) or any(feed.in_flight.values())
    if unfinished or feed.next_episode() is not None:
        raise TypeError(
            f"{type(model).__name__}.rollouts did not run its feed to the end: it took "
            f"{len(feed.drawn)} episodes, returned {len(rollouts.episodes)}, and the round "
            "had more; a family's rollouts must take the feed's episodes as rows free and "
            "say each one's end (services.training.family.EpisodeFeed)"
        )
    return SampledTasks(
        groups=feed.groups,
        generated_tokens=rollouts.generated_tokens,
        wall_s=time.monotonic() - started,
        utilisation=rollouts.utilisation,
    )


StoredEpisodes = list[list[list[TokenSequence]]]  # per task: its stored episodes' sequences


def stored_episodes(
    tasks: Sequence[TaskSpec], records: Sequence[EpisodeRecord], *, passed: bool, family: str
) -> StoredEpisodes:
    """The stored episodes (a train job's ``demonstrations.jsonl``) of each task, successes
    or failures, as training sequences. A record of another task or another model family
    (its token ids are another tokenizer's) is not this run's and is left out."""
    index = {task.task_id: i for i, task in enumerate(tasks)}
    out: StoredEpisodes = [[] for _ in tasks]
    for record in records:
        i = index.get(record.task_id)
        if i is not None and record.passed == passed and record.family == family:
            out[i].append([(list(ids), list(mask)) for ids, mask in record.sequences])
    return out


def success_sequences(
    sampled: SampledTasks, tasks: Sequence[TaskSpec], stored: StoredEpisodes | None = None
) -> tuple[list[TokenSequence], list[float]]:
    """The verified successes, sampled and ``stored`` (earlier runs' of the same task), as
    training sequences, each with its draw weight (the task's weight shared among its
    successes; an episode of several sequences shares it too)."""
    weights = task_weights(tasks) or [1.0] * len(tasks)
    earlier = stored or [[] for _ in tasks]
    sequences: list[TokenSequence] = []
    draw: list[float] = []
    for weight, group, kept in zip(weights, sampled.groups, earlier, strict=True):
        passed = [episode.sequences for episode in group if episode.reward.passed] + kept
        for parts in passed:
            for sequence in parts:
                sequences.append(sequence)
                draw.append(weight / len(passed) / len(parts))
    return sequences, draw


@dataclass(frozen=True)
class Replay:
    """The starting weights' verified episodes of the replay tasks, as training sequences
    with their draw weights (summing to 1), and what sampling them cost."""

    sequences: list[TokenSequence]
    weights: list[float]
    tasks: int
    episodes: int
    generated_tokens: int
    wall_s: float
    utilisation: Utilisation = field(default_factory=Utilisation)


def replay_tasks_drawn(
    replay_tasks: Sequence[TaskSpec], config: RFTConfig, *, exclude: Sequence[TaskSpec]
) -> list[TaskSpec]:
    """At most ``config.replay_tasks`` of the replay tasks, a seeded draw, none of them a
    task this run trains on (those are the new behaviour, not the old)."""
    if config.replay_fraction == 0:
        return []
    training = {task.task_id for task in exclude}
    pool = [task for task in replay_tasks if task.task_id not in training]
    if len(pool) <= config.replay_tasks:
        return pool
    return random.Random(derive_seed(config.seed, _REPLAY_STREAM)).sample(pool, config.replay_tasks)


def sample_replay(
    model: FamilyModel, env: Environment, tasks: Sequence[TaskSpec], config: RFTConfig
) -> Replay | None:
    """Sample the replay tasks once from the current (starting) weights and keep the
    verified episodes; None when there is nothing to replay."""
    if not tasks:
        return None
    plan = ReplaySampling(
        samples_per_task=config.replay_samples_per_task,
        temperature=config.replay_temperature,
        max_turns=config.max_turns,
        max_new_tokens=config.max_new_tokens,
        rollout_batch=config.rollout_batch,
    )
    seed = derive_seed(config.seed, _REPLAY_STREAM, 1)
    sampled = sample_episodes(model, env, tasks, plan, seed=seed)
    sequences, weights = success_sequences(sampled, tasks)
    total = sum(weights)
    return Replay(
        sequences=sequences,
        weights=[w / total for w in weights] if total > 0 else weights,
        tasks=len(tasks),
        episodes=sampled.episodes,
        generated_tokens=sampled.generated_tokens,
        wall_s=sampled.wall_s,
        utilisation=sampled.utilisation,
    )


def with_replay(
    sequences: list[TokenSequence],
    weights: list[float],
    replay: Replay | None,
    fraction: float,
) -> tuple[list[TokenSequence], list[float]]:
    """The iteration's successes and the replayed episodes in one draw, the replayed ones
    weighing ``fraction`` of it; the successes alone when there are none of either."""
    if not sequences or replay is None or not replay.sequences or fraction == 0:
        return sequences, weights
    total = sum(weights)
    return (
        sequences + replay.sequences,
        [w / total * (1 - fraction) for w in weights] + [w * fraction for w in replay.weights],
    )


def rare_successes(row: dict[str, Any]) -> str | None:
    """The sentence a round's row carries when its successes are rare (see the module's
    *Rare successes are said*); None when they are not."""
    episodes, passed, solved = int(row["episodes"]), int(row["successes"]), row["tasks_solved"]
    enough_tasks = min(RARE_SOLVED_TASKS, int(row["tasks"]))
    if not episodes or (passed >= RARE_SUCCESS_RATE * episodes and solved >= enough_tasks):
        return None
    return (
        f"round {row['iteration']}: {passed} of {episodes:,} episodes passed "
        f"({100 * passed / episodes:.2f}%), on {solved} of {row['tasks']} tasks: what it "
        "learns rests on so few successes that another seed may find none or others"
    )


@dataclass
class RFTResult:
    """What an rft run saw and did: per iteration and in total."""

    counters: RunCounters
    iterations: list[dict[str, Any]] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)

    @property
    def successes(self) -> int:
        return sum(int(row["successes"]) for row in self.iterations)

    def metrics(self) -> dict[str, Any]:
        """The figures an rft job writes to metrics.json."""
        trained = [row for row in self.iterations if row["trained"]]
        return {
            **self.counters.metrics(),
            "successes": self.successes,
            "iterations": self.iterations,
            "final_loss": self.counters.final_loss,
            "final_pass_rate": (
                self.iterations[-1]["successes"] / max(1, self.iterations[-1]["episodes"])
                if self.iterations
                else None
            ),
            "trained": bool(trained),
            "replay": self.replay,
            # the first rare round's sentence (the rows keep each one's), or None
            "rare_successes": next(
                (row["rare_successes"] for row in self.iterations if "rare_successes" in row),
                None,
            ),
        }


def _count_replay(result: RFTResult, replay: Replay, config: RFTConfig) -> None:
    """The replay's sampling is part of the run's cost, so its tokens, time and episodes
    count beside the iterations'."""
    result.counters.add_sampling(replay.generated_tokens, replay.wall_s, replay.episodes)
    result.counters.utilisation.merge(replay.utilisation)
    result.replay = {
        "tasks": replay.tasks,
        "episodes": replay.episodes,
        "sequences": len(replay.sequences),
        "fraction": config.replay_fraction,
    }


@dataclass
class _RunState:
    """What every iteration of one :func:`train_rft` run reads or adds to."""

    earlier: StoredEpisodes
    replay: Replay | None
    counters: RunCounters
    ctx: DistContext
    keeper: EpisodeKeeper | None


def _rft_iteration(
    model: FamilyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    config: RFTConfig,
    iteration: int,
    run_state: _RunState,
) -> dict[str, Any]:
    """One round: sample, keep the verified successes, SFT on them (with the replay); the
    round's row of ``RFTResult.iterations``."""
    earlier, replay, counters = run_state.earlier, run_state.replay, run_state.counters
    ctx, keeper = run_state.ctx, run_state.keeper
    model.train(False)
    sampled = sample_episodes(
        model,
        env,
        tasks,
        config,
        seed=config.seed,
        round_index=iteration,
        enough_successes=config.enough_successes,
        most_per_task=round(config.unsolved_sample_factor * config.samples_per_task),
    )
    counters.add_sampling(sampled.generated_tokens, sampled.wall_s, sampled.episodes)
    counters.utilisation.merge(sampled.utilisation)
    counters.groups += len(sampled.groups)
    if keeper is not None:
        keeper.add(episode for group in sampled.groups for episode in group)
    successes, success_draw = success_sequences(sampled, tasks, earlier)
    sequences, weights = with_replay(successes, success_draw, replay, config.replay_fraction)
    row: dict[str, Any] = {
        "iteration": iteration + 1,
        "episodes": sampled.episodes,
        "successes": sampled.successes,
        "stored_successes": sum(len(kept) for kept in earlier),
        "tasks_solved": sum(any(e.reward.passed for e in g) for g in sampled.groups),
        "tasks": len(tasks),
        # episodes beyond samples_per_task, spent on tasks that had no success yet
        "unsolved_extra_episodes": sum(
            max(0, len(group) - config.samples_per_task) for group in sampled.groups
        ),
        "sequences": len(successes),
        "replayed_sequences": len(sequences) - len(successes),
        "trained": bool(successes) and config.steps > 0,
        "loss": None,
    }
    if row["trained"]:
        sft = replace(config, seed=derive_seed(config.seed, _SAMPLE_STREAM, iteration))
        run = train_sft(model, sequences, sft, ctx=ctx, weights=weights)
        counters.steps_done += run.steps_done
        counters.train_tokens += run.train_tokens
        counters.train_s += run.train_s
        counters.add_phases(run.phase_s)
        counters.utilisation.merge(run.utilisation)
        counters.final_loss = run.final_loss
        counters.history.extend({**h, "iteration": float(iteration + 1)} for h in run.history)
        row["loss"] = run.final_loss
    elif ctx.is_main and not successes:
        logger.warning(
            "rft iteration %d: no verified success in %d episodes; the model is unchanged",
            iteration + 1,
            sampled.episodes,
        )
    rare = rare_successes(row)
    if rare is not None:
        row["rare_successes"] = rare
        if ctx.is_main:
            logger.warning("rft %s", rare)
    if ctx.is_main:
        logger.info(
            "rft iteration %d/%d: %d/%d episodes passed, %d of %d tasks solved, loss %s",
            iteration + 1,
            config.iterations,
            row["successes"],
            row["episodes"],
            row["tasks_solved"],
            len(tasks),
            row["loss"],
        )
    return row


def train_rft(
    model: FamilyModel,
    env: Environment,
    tasks: Sequence[TaskSpec],
    config: RFTConfig,
    *,
    ctx: DistContext,
    stored: Sequence[EpisodeRecord] = (),
    keeper: EpisodeKeeper | None = None,
    replay_tasks: Sequence[TaskSpec] = (),
) -> RFTResult:
    """Run ``config.iterations`` rounds of sample / keep the successes / SFT, in place.

    ``stored`` are earlier runs' verified episodes of these tasks (the probe's, a previous
    cycle's): their successes join every iteration's SFT set, so a success found once is
    trained on even when this run's samples find none. ``keeper`` is handed every episode
    sampled. ``replay_tasks`` are tasks the starting weights already handle (see the
    module's *Replay*)."""
    if not tasks:
        raise ValueError("RFT needs at least one task")
    earlier = stored_episodes(tasks, stored, passed=True, family=model.family)
    result = RFTResult(counters=RunCounters())
    model.train(False)
    replay = sample_replay(
        model, env, replay_tasks_drawn(replay_tasks, config, exclude=tasks), config
    )
    if replay is not None:
        _count_replay(result, replay, config)
    run_state = _RunState(earlier, replay, result.counters, ctx, keeper)
    for iteration in range(config.iterations):
        result.iterations.append(_rft_iteration(model, env, tasks, config, iteration, run_state))
    model.train(False)
    return result

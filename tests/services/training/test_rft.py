"""RFT: it trains on the verified successes and nothing else; without a success it says so
and leaves the model as it was; its hyper-parameters are refused by name."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.environments import write_task_file
from services.environments.base import Environment, Reward, TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.utilisation import TIME_PARTS
from services.training.config import HyperparameterError, RFTConfig, parse_hyperparameters
from services.training.distributed import init_distributed
from services.training.family import FamilyModel, PackedBatch, Rollouts, TokenEpisode, family_for
from services.training.rft import (
    SampleBudget,
    SampledTasks,
    rare_successes,
    sample_episodes,
    success_sequences,
    train_rft,
)
from tests.services.training.conftest import read_metrics, run_train_job


class Recording:
    """A family model that remembers the episodes it sampled and the rows it was trained on
    (a ``logprobs`` call with gradients enabled), and otherwise is the model it wraps."""

    def __init__(self, model: FamilyModel) -> None:
        self.inner = model
        self.sampled: list[TokenEpisode] = []
        self.trained_rows: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def rollouts(self, env: Environment, tasks: Sequence[TaskSpec], **kwargs: Any) -> Rollouts:
        rollouts = self.inner.rollouts(env, tasks, **kwargs)
        self.sampled.extend(rollouts.episodes)
        return rollouts

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        if torch.is_grad_enabled():
            for ids, attention in zip(batch.ids.tolist(), batch.attention.tolist(), strict=True):
                self.trained_rows.append(ids[: sum(attention)])
        return self.inner.logprobs(batch)


def mixed_tasks() -> list[TaskSpec]:
    """v1 tasks the capable champion solves when it samples, and v3 tasks it never does."""
    env = ToolcalcEnvironment()
    return env.generate_tasks(4, seed=31, api_version="v1") + env.generate_tasks(
        4, seed=32, api_version="v3"
    )


def load(checkpoint: Path) -> FamilyModel:
    return family_for("tiny").load(checkpoint, device=torch.device("cpu"), training=RFTConfig())


def test_rft_trains_only_on_verified_successes(capable_champion: Path) -> None:
    model = Recording(load(capable_champion))
    config = RFTConfig(
        samples_per_task=4, max_new_tokens=48, steps=3, batch_size=8, iterations=2, log_every=0
    )
    result = train_rft(
        model, ToolcalcEnvironment(), mixed_tasks(), config, ctx=init_distributed("cpu")
    )

    passed = [e for e in model.sampled if e.reward.passed]
    failed = [e for e in model.sampled if not e.reward.passed]
    assert passed and failed, "the task set must have both for this test to mean anything"
    success_ids = {tuple(ids) for e in passed for ids, _ in e.sequences}
    failure_ids = {tuple(ids) for e in failed for ids, _ in e.sequences} - success_ids
    assert model.trained_rows and {tuple(row) for row in model.trained_rows} <= success_ids
    assert not {tuple(row) for row in model.trained_rows} & failure_ids
    assert len(model.sampled) == 2 * 8 * 4
    assert [row["episodes"] for row in result.iterations] == [32, 32]
    assert result.successes == len(passed)
    assert all(row["trained"] and row["loss"] is not None for row in result.iterations)
    assert result.counters.steps_done == 6
    # the job's utilisation figures: its rounds and its SFT passes, against the peak
    metrics = result.metrics()
    assert metrics["rollout_mfu"] > 0 and metrics["train_mfu"] > 0
    assert metrics["peak_gflops"]["rollout"] > 0 and metrics["peak_gflops"]["train"] > 0
    assert set(metrics["time_split"]) == set(TIME_PARTS)
    assert metrics["forward_calls"]["decode_calls"] > 0


def episode(task: TaskSpec, ids: list[int], *, passed: bool) -> TokenEpisode:
    reward = Reward(components={}, total=1.0 if passed else 0.0, passed=passed)
    return TokenEpisode(
        task=task, turns=[(ids[:1], ids[1:])], reward=reward, end_reason=None, answer=None
    )


def test_successes_weigh_by_task_weight_shared_among_their_successes() -> None:
    env = ToolcalcEnvironment()
    heavy, light = env.generate_tasks(2, seed=3, api_version="v1")
    heavy = dataclasses.replace(heavy, metadata={"ratchet": {"weight": 6}})
    sampled = SampledTasks(
        groups=[
            [episode(heavy, [1, 2], passed=True), episode(heavy, [1, 3], passed=True)],
            [episode(light, [1, 4], passed=True), episode(light, [1, 5], passed=False)],
        ],
        generated_tokens=0,
        wall_s=0.0,
    )
    sequences, weights = success_sequences(sampled, [heavy, light])
    assert [ids for ids, _ in sequences] == [[1, 2], [1, 3], [1, 4]]
    assert weights == [3.0, 3.0, 1.0]


def test_rft_without_a_success_says_so_and_leaves_the_model_unchanged(
    capable_champion: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "v3.jsonl"
    write_task_file(dataset, ToolcalcEnvironment().generate_tasks(4, seed=32, api_version="v3"))
    code = run_train_job(
        tmp_path,
        algorithm="rft",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=capable_champion,
        hyperparameters={"samples_per_task": 2, "max_new_tokens": 48, "steps": 5, "log_every": 0},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["algorithm"] == "rft"
    assert (metrics["successes"], metrics["trained"], metrics["steps"]) == (0, False, 0)
    assert metrics["episodes"] == 8 and metrics["iterations"][0]["trained"] is False
    assert set(metrics["phases"]) == {"rollout", "sync"}  # sampling is priced as rollout
    before = load(capable_champion).trainable_parameters()
    after = load(tmp_path / "out" / "checkpoint").trainable_parameters()
    for (name, old), (_, new) in zip(before, after, strict=True):
        assert torch.equal(old, new), name


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"iterations": 0}, "iterations"),
        ({"samples_per_task": 0}, "samples_per_task"),
        ({"temperature": 0.0}, "temperature"),
        ({"rollout_batch": "8"}, "rollout_batch"),
        ({"beta": 0.1}, "beta"),  # dpo's, not rft's
    ],
)
def test_bad_rft_hyperparameters_name_the_field(raw: dict[str, object], key: str) -> None:
    with pytest.raises(HyperparameterError) as refused:
        parse_hyperparameters("tiny", "rft", raw)
    assert refused.value.key == key and key in refused.value.message


def test_a_task_with_enough_successes_is_sampled_no_more_in_its_round(
    capable_champion: Path,
) -> None:
    tasks = mixed_tasks()
    model = Recording(load(capable_champion))
    options = RFTConfig(samples_per_task=6, max_new_tokens=48, rollout_batch=len(tasks))
    env = ToolcalcEnvironment()
    sampled = sample_episodes(model, env, tasks, options, seed=3, enough_successes=1)

    solved = [group for group in sampled.groups if any(e.reward.passed for e in group)]
    unsolved = [group for group in sampled.groups if group not in solved]
    assert solved and unsolved, "the task set must have both for this test to mean anything"
    for group in solved:  # one wave holds one episode of each task: nothing overshoots
        assert [e.reward.passed for e in group].count(True) == 1 and group[-1].reward.passed
    assert all(len(group) == 6 for group in unsolved)
    assert sampled.episodes == len(model.sampled) < 6 * len(tasks)


def test_a_round_is_one_rollout_call_whose_rows_take_the_next_episode_as_they_free(
    capable_champion: Path,
) -> None:
    """The round hands the family a feed, not a list: ``rollout_batch`` rows decode and each
    that frees takes the next episode the budget allows, so no call waits on its slowest
    episode before the next starts."""
    tasks = mixed_tasks()
    model = Recording(load(capable_champion))
    calls: list[tuple[int, Any]] = []
    inner = model.rollouts

    def counted(env: Environment, episodes: Sequence[TaskSpec], **kwargs: Any) -> Rollouts:
        calls.append((len(episodes), kwargs.get("max_rows")))
        return inner(env, episodes, **kwargs)

    model.rollouts = counted  # type: ignore[method-assign]
    options = RFTConfig(samples_per_task=3, max_new_tokens=48, rollout_batch=5)
    sampled = sample_episodes(model, ToolcalcEnvironment(), tasks, options, seed=3)
    assert calls == [(0, 5)]
    assert sampled.episodes == len(model.sampled) == 3 * len(tasks)


def test_a_family_whose_rollouts_ignore_the_feed_is_refused(capable_champion: Path) -> None:
    class ListsOnly(Recording):
        def rollouts(self, env: Environment, tasks: Sequence[TaskSpec], **kwargs: Any) -> Rollouts:
            kwargs.pop("feed")
            return self.inner.rollouts(env, tasks, **kwargs)

    model = ListsOnly(load(capable_champion))
    with pytest.raises(TypeError, match=r"ListsOnly\.rollouts did not run its feed"):
        sample_episodes(model, ToolcalcEnvironment(), mixed_tasks(), RFTConfig(), seed=3)


def test_without_enough_successes_every_task_gets_every_sample_the_same_episodes(
    capable_champion: Path,
) -> None:
    tasks = mixed_tasks()
    options = RFTConfig(samples_per_task=3, max_new_tokens=48, rollout_batch=5)
    sampled = sample_episodes(load(capable_champion), ToolcalcEnvironment(), tasks, options, seed=3)
    capped = sample_episodes(
        load(capable_champion),
        ToolcalcEnvironment(),
        tasks,
        dataclasses.replace(options, rollout_batch=len(tasks)),
        seed=3,
        enough_successes=99,
    )
    assert [len(group) for group in sampled.groups] == [3] * len(tasks)
    assert [[e.sequences for e in g] for g in sampled.groups] == [
        [e.sequences for e in g] for g in capped.groups
    ]


def test_rft_rounds_stop_sampling_a_task_at_enough_successes(capable_champion: Path) -> None:
    tasks = mixed_tasks()
    config = RFTConfig(
        samples_per_task=6,
        max_new_tokens=48,
        steps=1,
        batch_size=4,
        log_every=0,
        rollout_batch=len(tasks),
    )
    full = train_rft(
        load(capable_champion), ToolcalcEnvironment(), tasks, config, ctx=init_distributed("cpu")
    )
    capped = train_rft(
        load(capable_champion),
        ToolcalcEnvironment(),
        tasks,
        dataclasses.replace(config, enough_successes=1),
        ctx=init_distributed("cpu"),
    )
    assert full.iterations[0]["episodes"] == 6 * len(tasks)
    # What the solved tasks leave goes to the unsolved ones (up to twice their share), so
    # the round is no longer than without the cap and solves at least as many tasks.
    assert capped.iterations[0]["episodes"] <= full.iterations[0]["episodes"]
    assert capped.iterations[0]["unsolved_extra_episodes"] > 0
    assert capped.iterations[0]["tasks_solved"] >= full.iterations[0]["tasks_solved"]
    # Without that (a factor of 1) the cap saves the episodes instead.
    saving = train_rft(
        load(capable_champion),
        ToolcalcEnvironment(),
        tasks,
        dataclasses.replace(config, enough_successes=1, unsolved_sample_factor=1.0),
        ctx=init_distributed("cpu"),
    )
    assert saving.iterations[0]["episodes"] < full.iterations[0]["episodes"]
    assert saving.iterations[0]["unsolved_extra_episodes"] == 0


def _drain(budget: SampleBudget, passes: dict[int, list[bool]]) -> list[tuple[int, int]]:
    """Every (task, sample index) the budget hands out, one at a time, each episode of task
    ``i`` passing as ``passes[i]`` says in order (failing past its end)."""
    drawn: list[tuple[int, int]] = []
    while (i := budget.next()) is not None:
        sample = budget.count[i] - 1
        drawn.append((i, sample))
        outcomes = passes.get(i, [])
        budget.record(i, sample < len(outcomes) and outcomes[sample])
    return drawn


def test_a_round_samples_in_waves_and_tasks_with_no_success_first() -> None:
    # Task 0 passes its first episode: in the next wave it comes after tasks 1 and 2.
    drawn = _drain(SampleBudget(3, per_task=2, enough=0, most=0), {0: [True]})
    assert drawn == [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1), (0, 1)]


def test_what_solved_tasks_leave_goes_to_unsolved_ones_up_to_their_cap() -> None:
    # Task 0 passes at once (enough at 1): it leaves 3 of its 4 samples. Tasks 1 and 2 never
    # pass: they share them, up to 6 each. The round stays within 4 x 3 episodes.
    drawn = _drain(SampleBudget(3, per_task=4, enough=1, most=6), {0: [True]})
    per_task = [sum(1 for i, _ in drawn if i == task) for task in range(3)]
    assert per_task == [1, 6, 5] and len(drawn) == 12
    assert sorted(drawn) == sorted(set(drawn))  # every (task, sample) once: its own seed
    # A solved task never takes more than its share, and without enough_successes nothing
    # is left over to give.
    drawn = _drain(SampleBudget(3, per_task=4, enough=0, most=6), {0: [True]})
    assert [sum(1 for i, _ in drawn if i == task) for task in range(3)] == [4, 4, 4]
    drawn = _drain(SampleBudget(2, per_task=2, enough=2, most=8), {0: [True, False, True]})
    assert [sum(1 for i, _ in drawn if i == task) for task in range(2)] == [2, 2]


def test_a_round_with_rare_successes_says_so(capable_champion: Path) -> None:
    """The capable champion never solves v3 tasks: its round is flagged, in the row and in
    the metrics."""
    env = ToolcalcEnvironment()
    config = RFTConfig(samples_per_task=2, max_new_tokens=48, steps=1, batch_size=2, log_every=0)
    hard = env.generate_tasks(4, seed=32, api_version="v3")
    result = train_rft(load(capable_champion), env, hard, config, ctx=init_distributed("cpu"))
    note = result.metrics()["rare_successes"]
    assert note == result.iterations[0]["rare_successes"]
    assert note.startswith("round 1: 0 of 8 episodes passed (0.00%), on 0 of 4 tasks")
    # A round with successes on most tasks is not rare, nor one that solved every task of
    # a small set; one passing episode in 1,024 is.
    assert (
        rare_successes(
            {"iteration": 1, "episodes": 100, "successes": 40, "tasks_solved": 10, "tasks": 12}
        )
        is None
    )
    assert (
        rare_successes(
            {"iteration": 2, "episodes": 8, "successes": 4, "tasks_solved": 2, "tasks": 2}
        )
        is None
    )
    assert rare_successes(
        {"iteration": 1, "episodes": 1024, "successes": 1, "tasks_solved": 1, "tasks": 64}
    ) == (
        "round 1: 1 of 1,024 episodes passed (0.10%), on 1 of 64 tasks: what it learns "
        "rests on so few successes that another seed may find none or others"
    )


def test_with_enough_successes_no_more_episodes_of_a_task_run_than_it_needs() -> None:
    """An episode's outcome is known only when it ends: as many episodes of a task run at
    once as the task still needs successes, so no task overshoots ``enough``."""
    budget = SampleBudget(2, per_task=4, enough=1, most=0)
    in_flight: Counter[int] = Counter()
    picks = []
    while (i := budget.next(in_flight)) is not None:
        picks.append(i)
        in_flight[i] += 1
    assert picks == [0, 1]
    budget.record(0, True)  # task 0 is done; task 1 goes on, one episode at a time
    assert [budget.next(), budget.next({1: 1})] == [1, None]
    # Needing two successes, two episodes of each task run at once, in waves (every task's
    # first episode before any task's second); one success in, one more episode at a time.
    budget = SampleBudget(2, per_task=4, enough=2, most=0)
    in_flight = Counter()
    picks = []
    while (i := budget.next(in_flight)) is not None:
        picks.append((i, budget.count[i] - 1))
        in_flight[i] += 1
    assert picks == [(0, 0), (1, 0), (0, 1), (1, 1)]
    budget.record(0, True)
    budget.record(0, False)
    budget.record(1, False)
    budget.record(1, False)
    in_flight = Counter()
    picks = []
    while (i := budget.next(in_flight)) is not None:
        picks.append(i)
        in_flight[i] += 1
    assert sorted(picks) == [0, 1, 1]

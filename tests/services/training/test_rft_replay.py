"""RFT's replay: the starting weights' own verified episodes of tasks they already handle
join every SFT draw at ``replay_fraction`` of its weight, sampled once; replay alone never
trains; a train job reads them from ``replay_dataset`` and refuses a bad one by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from services.environments import write_task_file
from services.environments.base import TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.training.config import HyperparameterError, RFTConfig
from services.training.distributed import init_distributed
from services.training.rft import Replay, replay_tasks_drawn, train_rft, with_replay
from tests.services.training.conftest import read_metrics, run_train_job
from tests.services.training.test_rft import Recording, load

V1 = ToolcalcEnvironment().generate_tasks(6, seed=31, api_version="v1")
V3 = ToolcalcEnvironment().generate_tasks(4, seed=32, api_version="v3")


def replay_of(*weights: float) -> Replay:
    return Replay(
        sequences=[([9, i], [0, 1]) for i, _ in enumerate(weights)],
        weights=list(weights),
        tasks=len(weights),
        episodes=len(weights),
        generated_tokens=0,
        wall_s=0.0,
    )


def test_the_replayed_episodes_weigh_the_replay_fraction_of_the_draw() -> None:
    successes = [([1, 2], [0, 1]), ([1, 3], [0, 1])]
    sequences, weights = with_replay(successes, [3.0, 1.0], replay_of(0.5, 0.5), 0.25)
    assert sequences == successes + replay_of(0.5, 0.5).sequences
    assert weights == pytest.approx([0.5625, 0.1875, 0.125, 0.125])
    assert sum(weights[:2]) == pytest.approx(0.75)


def test_without_new_successes_or_replay_the_draw_is_the_successes_alone() -> None:
    successes = [([1, 2], [0, 1])]
    assert with_replay([], [], replay_of(1.0), 0.5) == ([], [])
    assert with_replay(successes, [2.0], None, 0.5) == (successes, [2.0])
    assert with_replay(successes, [2.0], replay_of(1.0), 0.0) == (successes, [2.0])


def test_replay_draws_at_most_replay_tasks_and_none_of_the_training_tasks() -> None:
    config = RFTConfig(replay_tasks=3, seed=5)
    drawn = replay_tasks_drawn(V1, config, exclude=V1[:2])
    assert len(drawn) == 3
    assert not {t.task_id for t in drawn} & {t.task_id for t in V1[:2]}
    assert drawn == replay_tasks_drawn(V1, config, exclude=V1[:2])  # seeded
    assert replay_tasks_drawn(V1, RFTConfig(replay_fraction=0.0), exclude=[]) == []
    assert replay_tasks_drawn(V1[:2], config, exclude=[]) == V1[:2]


def config(**changes: object) -> RFTConfig:
    values: dict[str, object] = {
        "samples_per_task": 4,
        "max_new_tokens": 48,
        "steps": 3,
        "batch_size": 8,
        "log_every": 0,
        "replay_samples": 2,
        "replay_fraction": 0.5,
    }
    return RFTConfig(**{**values, **changes})  # type: ignore[arg-type]


def test_rft_replays_the_starting_weights_successes_sampled_once(
    capable_champion: Path,
) -> None:
    model = Recording(load(capable_champion))
    tasks = V1[:2] + V3
    result = train_rft(
        model,
        ToolcalcEnvironment(),
        tasks,
        config(iterations=2, steps=6),
        ctx=init_distributed("cpu"),
        replay_tasks=V1[2:],
    )

    replayed = model.sampled[:4]  # decoded first, greedily, from the starting weights
    assert sorted(e.task.task_id for e in replayed) == sorted(t.task_id for t in V1[2:])
    assert len(model.sampled) == 4 + 2 * len(tasks) * 4
    replay_ids = {tuple(ids) for e in replayed if e.reward.passed for ids, _ in e.sequences}
    new_ids = {tuple(ids) for e in model.sampled[4:] if e.reward.passed for ids, _ in e.sequences}
    trained = {tuple(row) for row in model.trained_rows}
    assert replay_ids and trained <= replay_ids | new_ids
    assert trained & replay_ids, "the replayed episodes are drawn into the SFT batches"
    metrics = result.metrics()
    assert metrics["replay"] == {
        "tasks": 4,
        "episodes": 4,
        "sequences": sum(len(e.sequences) for e in replayed if e.reward.passed),
        "fraction": 0.5,
    }
    assert metrics["episodes"] == 4 + 2 * len(tasks) * 4
    assert all(
        row["replayed_sequences"] == metrics["replay"]["sequences"] for row in metrics["iterations"]
    )
    assert result.successes == sum(e.reward.passed for e in model.sampled[4:])
    phases = result.counters.phase_s  # the replay's and the rounds' sampling, the SFT steps
    assert set(phases) == {"rollout", "update"} and all(v > 0 for v in phases.values())


def test_replay_is_the_starting_weights_greedy_episodes_unless_it_is_given_a_temperature(
    capable_champion: Path,
) -> None:
    """Greedy by default: one episode a task, the one the gate's regression suite checks
    (token for token the model's own greedy rollout); with ``replay_temperature`` > 0,
    ``replay_samples`` sampled episodes a task."""
    env, replay = ToolcalcEnvironment(), V1[2:]
    greedy = Recording(load(capable_champion))
    train_rft(greedy, env, V3, config(steps=0), ctx=init_distributed("cpu"), replay_tasks=replay)
    by_task = {e.task.task_id: e for e in greedy.sampled[:4]}
    decoded = load(capable_champion).rollouts(
        env, replay, seeds=[0] * 4, max_turns=4, max_new_tokens=48, temperature=0.0
    )
    assert [by_task[e.task.task_id].turns for e in decoded.episodes] == [
        e.turns for e in decoded.episodes
    ]

    sampled = Recording(load(capable_champion))
    result = train_rft(
        sampled,
        env,
        V3,
        config(steps=0, replay_temperature=1.0),
        ctx=init_distributed("cpu"),
        replay_tasks=replay,
    )
    assert result.metrics()["replay"]["episodes"] == 2 * 4
    with pytest.raises(HyperparameterError, match="replay_temperature must be >= 0"):
        config(replay_temperature=-0.5)


def test_replay_alone_never_trains(capable_champion: Path) -> None:
    model = load(capable_champion)
    before = {name: p.detach().clone() for name, p in model.trainable_parameters()}
    result = train_rft(
        model, ToolcalcEnvironment(), V3, config(), ctx=init_distributed("cpu"), replay_tasks=V1
    )
    assert result.successes == 0 and result.metrics()["replay"]["sequences"] > 0
    assert not result.iterations[0]["trained"]
    assert all(torch.equal(before[name], p) for name, p in model.trainable_parameters())


def test_a_train_job_replays_its_replay_dataset(capable_champion: Path, tmp_path: Path) -> None:
    dataset, replay = tmp_path / "train.jsonl", tmp_path / "replay.jsonl"
    write_task_file(dataset, V1[:2] + V3)
    write_task_file(replay, V1[2:])
    code = run_train_job(
        tmp_path,
        algorithm="rft",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=capable_champion,
        replay_dataset=str(replay),
        hyperparameters={"samples_per_task": 2, "max_new_tokens": 48, "steps": 2, "log_every": 0},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["replay"]["tasks"] == 4 and metrics["replay"]["episodes"] == 4
    assert metrics["hyperparameters"]["replay_fraction"] == 0.5
    # both passes are measured against the machine (a tiny-family job: the mismatch watch,
    # which hf jobs train through, is tested on its own in test_mismatch.py)
    assert metrics["rollout_mfu"] > 0 and metrics["train_mfu"] > 0


@pytest.mark.parametrize(
    ("replay_dataset", "message"),
    [
        ("", "spec 'replay_dataset' must be the path of a task file"),
        (7, "spec 'replay_dataset' must be the path of a task file"),
        ("missing.jsonl", "replay_dataset .*missing.jsonl does not exist"),
        ("bad.jsonl", "invalid replay_dataset: "),
        ("foreign.jsonl", r"replay_dataset has tasks of environment\(s\) \['other'\]"),
    ],
)
def test_a_bad_replay_dataset_is_refused_by_name_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replay_dataset: object, message: str
) -> None:
    dataset = tmp_path / "train.jsonl"
    write_task_file(dataset, V3)
    (tmp_path / "bad.jsonl").write_text("{not json\n", encoding="utf-8")
    task = V1[0]
    foreign = TaskSpec.create(
        environment="other", prompt=task.prompt, tools=task.tools, verifier=task.verifier
    )
    write_task_file(tmp_path / "foreign.jsonl", [foreign])
    named = isinstance(replay_dataset, str) and replay_dataset
    path = str(tmp_path / replay_dataset) if named else replay_dataset
    code = run_train_job(
        tmp_path,
        algorithm="rft",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=tmp_path / "no-checkpoint-needed-before-this",
        replay_dataset=path,
    )
    assert code == 2
    assert re.search(message, capsys.readouterr().err)

"""Keep every success: a job keeps its verified episodes with their exact tokens, the file
is trusted only as far as its listing, and the next run's rft and dpo train on them even
when their own samples find no success."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.environments import write_task_file
from services.environments.base import Environment, Reward, TaskSpec
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.job import eval_job_main
from services.training.config import DPOConfig, RFTConfig
from services.training.distributed import init_distributed
from services.training.dpo import train_dpo
from services.training.episode_file import (
    EPISODES_FILE,
    EpisodeFileError,
    EpisodeRecord,
    keep_episodes_option,
    read_demonstrations,
    read_listed_episodes,
    write_demonstrations,
    write_episodes,
)
from services.training.family import (
    EpisodeFeed,
    FamilyModel,
    PackedBatch,
    Rollouts,
    TokenEpisode,
    family_for,
)
from services.training.keep import EpisodeKeeper
from services.training.rft import train_rft
from tests.services.training.conftest import read_metrics, run_train_job


class AlwaysFails:
    """A family model whose every sampled episode fails its verifier (a drifted champion),
    and which remembers the rows it was trained on."""

    def __init__(self, model: FamilyModel) -> None:
        self.inner = model
        self.trained_rows: list[tuple[int, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        feed: EpisodeFeed | None = None,
        **kwargs: Any,
    ) -> Rollouts:
        failing = None if feed is None else FailingFeed(feed)
        rollouts = self.inner.rollouts(env, tasks, feed=failing, **kwargs)
        episodes = [failed(e) for e in rollouts.episodes]
        return dataclasses.replace(rollouts, episodes=episodes)

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        if torch.is_grad_enabled():
            for ids, attention in zip(batch.ids.tolist(), batch.attention.tolist(), strict=True):
                self.trained_rows.append(tuple(ids[: sum(attention)]))
        return self.inner.logprobs(batch)


def failed(episode: TokenEpisode) -> TokenEpisode:
    return dataclasses.replace(episode, reward=Reward(total=0.0, passed=False, components={}))


class FailingFeed:
    """Tells the feed it wraps that every episode failed."""

    def __init__(self, feed: EpisodeFeed) -> None:
        self.feed = feed

    def next_episode(self) -> tuple[TaskSpec, int] | None:
        return self.feed.next_episode()

    def episode_ended(self, index: int, episode: TokenEpisode) -> None:
        self.feed.episode_ended(index, failed(episode))


def v1_tasks() -> list[TaskSpec]:
    return ToolcalcEnvironment().generate_tasks(4, seed=31, api_version="v1")


def load(checkpoint: Path, config: RFTConfig | DPOConfig) -> FamilyModel:
    return family_for("tiny").load(checkpoint, device=torch.device("cpu"), training=config)


def first_cycle_file(champion: Path, out: Path) -> Path:
    """Cycle 1: rft samples from the champion and keeps its verified episodes; the job's
    episodes.jsonl goes through its listing, then becomes the next run's input file."""
    config = RFTConfig(samples_per_task=4, max_new_tokens=48, steps=0, log_every=0)
    model = load(champion, config)
    keeper = EpisodeKeeper(model, per_task=3, failures_alone=False)
    train_rft(
        model, ToolcalcEnvironment(), v1_tasks(), config, ctx=init_distributed("cpu"), keeper=keeper
    )
    listing = write_episodes(out, keeper.records())
    records = read_listed_episodes(out, {"episode_file": listing})
    assert any(r.passed for r in records), "the champion must find a success for this test"
    path = out / "demonstrations.jsonl"
    write_demonstrations(path, records)
    return path


def test_a_success_kept_by_one_run_is_trained_on_by_the_next_rft(
    capable_champion: Path, tmp_path: Path
) -> None:
    stored = read_demonstrations(first_cycle_file(capable_champion, tmp_path))
    successes = {tuple(ids) for r in stored if r.passed for ids, _ in r.sequences}
    assert all(r.family == "tiny" and r.text for r in stored)

    config = RFTConfig(samples_per_task=2, max_new_tokens=48, steps=2, batch_size=4, log_every=0)
    model = AlwaysFails(load(capable_champion, config))
    result = train_rft(
        model, ToolcalcEnvironment(), v1_tasks(), config, ctx=init_distributed("cpu"), stored=stored
    )

    assert result.iterations[0]["successes"] == 0  # its own samples found nothing
    assert result.iterations[0]["stored_successes"] == sum(r.passed for r in stored)
    assert result.metrics()["trained"] is True
    assert model.trained_rows and set(model.trained_rows) <= successes


def test_the_next_dpo_pairs_stored_successes_with_failures_of_the_same_task(
    capable_champion: Path, tmp_path: Path
) -> None:
    stored = read_demonstrations(first_cycle_file(capable_champion, tmp_path))
    solved = {r.task_id for r in stored if r.passed}
    config = DPOConfig(samples_per_task=2, max_new_tokens=48, steps=1, batch_size=2, log_every=0)
    model = AlwaysFails(load(capable_champion, config))
    result = train_dpo(
        model, ToolcalcEnvironment(), v1_tasks(), config, ctx=init_distributed("cpu"), stored=stored
    )
    assert result.successes == 0
    assert result.pairs >= len(solved) > 0
    assert result.tasks_paired == len(solved)
    assert result.counters.steps_done == 1


def test_stored_episodes_of_another_family_or_task_are_not_used(
    capable_champion: Path, tmp_path: Path
) -> None:
    stored = read_demonstrations(first_cycle_file(capable_champion, tmp_path))
    foreign = [dataclasses.replace(r, family="hf") for r in stored] + [
        dataclasses.replace(r, task_id="0" * 64) for r in stored
    ]
    config = RFTConfig(samples_per_task=1, max_new_tokens=48, steps=1, batch_size=2, log_every=0)
    model = AlwaysFails(load(capable_champion, config))
    result = train_rft(
        model,
        ToolcalcEnvironment(),
        v1_tasks(),
        config,
        ctx=init_distributed("cpu"),
        stored=foreign,
    )
    assert result.iterations[0]["stored_successes"] == 0
    assert result.metrics()["trained"] is False


def record(task_id: str = "a" * 64, passed: bool = True) -> EpisodeRecord:
    return EpisodeRecord(
        task_id=task_id,
        passed=passed,
        reward=1.0 if passed else 0.0,
        text="add(2, 3)",
        sequences=[([1, 2, 3], [False, True, True])],
        checkpoint_id="ckpt-1",
        family="tiny",
    )


def listed(tmp_path: Path, records: Sequence[EpisodeRecord]) -> dict[str, Any]:
    return {"episode_file": write_episodes(tmp_path, records)}


def test_the_listing_round_trips_exact_tokens(tmp_path: Path) -> None:
    records = [record(), record(passed=False)]
    metrics = listed(tmp_path, records)
    assert metrics["episode_file"]["kinds"] == ["failure", "success"]
    assert read_listed_episodes(tmp_path, metrics) == records
    assert read_listed_episodes(tmp_path, {}) == []


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m: m.update(sha256="0" * 64), "sha256"),
        (lambda m: m.update(bytes=m["bytes"] + 1), "bytes"),
        (lambda m: m.update(count=5), "listing says 5"),
        (lambda m: m.update(kinds=["success"]), "does not declare"),
        (lambda m: m.update(kinds=["demonstration"]), "kinds"),
        (lambda m: m.update(kinds=[{}]), "kinds"),
        (lambda m: m.update(file="../metrics.json"), "file"),
        (lambda m: m.update(count=-1), "count"),
    ],
)
def test_a_file_its_listing_does_not_vouch_for_is_refused(
    tmp_path: Path, change: Any, words: str
) -> None:
    metrics = listed(tmp_path, [record(), record(passed=False)])
    change(metrics["episode_file"])
    with pytest.raises(EpisodeFileError, match=words):
        read_listed_episodes(tmp_path, metrics)


def test_a_symlinked_episode_file_is_refused(tmp_path: Path) -> None:
    metrics = listed(tmp_path, [record()])
    target = tmp_path / "elsewhere"
    (tmp_path / EPISODES_FILE).rename(target)
    os.symlink(target, tmp_path / EPISODES_FILE)
    with pytest.raises(EpisodeFileError, match="regular file"):
        read_listed_episodes(tmp_path, metrics)


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"passed": "yes"}, "passed"),
        ({"reward": float("nan")}, "NaN is not a JSON number"),  # refused as it is parsed
        ({"reward": "high"}, "reward"),
        ({"task_id": ""}, "task_id"),
        ({"sequences": [[[1, -2], [True, True]]]}, "ids"),
        ({"sequences": [[[1, 2], [True]]]}, "mask"),
        ({"sequences": []}, "sequences"),
        ({"family": None}, "family"),
    ],
)
def test_a_malformed_line_is_refused_by_field(
    tmp_path: Path, row: dict[str, Any], field: str
) -> None:
    good = json.loads(record().to_json())
    path = tmp_path / "demonstrations.jsonl"
    path.write_text(json.dumps({**good, **row}, allow_nan=True) + "\n")
    with pytest.raises(EpisodeFileError, match=f"line 1.*{field}"):
        read_demonstrations(path)


def test_the_keeper_bounds_each_task_and_keeps_failures_only_beside_a_success(
    capable_champion: Path,
) -> None:
    config = RFTConfig(samples_per_task=6, max_new_tokens=48, steps=0, log_every=0)
    model = load(capable_champion, config)
    env = ToolcalcEnvironment()
    tasks = v1_tasks() + env.generate_tasks(2, seed=32, api_version="v3")  # v3: never solved
    episodes = model.rollouts(
        env, tasks * 6, seeds=list(range(36)), max_turns=5, max_new_tokens=48, temperature=1.0
    ).episodes
    for failures_alone in (False, True):
        keeper = EpisodeKeeper(model, per_task=2, failures_alone=failures_alone)
        keeper.add(episodes)
        kept = keeper.records()
        for task in tasks:
            mine = [r for r in kept if r.task_id == task.task_id]
            assert sum(r.passed for r in mine) <= 2 and sum(not r.passed for r in mine) <= 2
            if not failures_alone and not any(r.passed for r in mine):
                assert mine == []
        unsolved = {t.task_id for t in tasks[4:]}
        assert any(r.task_id in unsolved for r in kept) is failures_alone


def test_keep_episodes_must_be_a_non_negative_integer() -> None:
    assert keep_episodes_option({}) == 0
    assert keep_episodes_option({"keep_episodes": 4}) == 4
    for bad in (-1, True, "4", 1.5):
        with pytest.raises(EpisodeFileError, match="keep_episodes"):
            keep_episodes_option({"keep_episodes": bad})


def test_the_train_job_keeps_its_episodes_and_reads_stored_ones(
    capable_champion: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = tmp_path / "tasks.jsonl"
    write_task_file(dataset, v1_tasks())
    stored = first_cycle_file(capable_champion, tmp_path / "cycle1")
    root = tmp_path / "cycle2"
    code = run_train_job(
        root,
        algorithm="rft",
        dataset=dataset,
        base_checkpoint=capable_champion,
        keep_episodes=2,
        demonstrations=str(stored),
        hyperparameters={"samples_per_task": 2, "max_new_tokens": 48, "steps": 1, "log_every": 0},
    )
    assert code == 0, capsys.readouterr().err
    metrics = read_metrics(root)
    assert metrics["iterations"][0]["stored_successes"] > 0
    kept = read_listed_episodes(root / "out", metrics)
    assert kept and all(
        r.passed or any(k.passed and k.task_id == r.task_id for k in kept) for r in kept
    )


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"keep_episodes": -1}, "keep_episodes"),
        ({"demonstrations": 7}, "demonstrations"),
        ({"demonstrations": "/nonexistent/demonstrations.jsonl"}, "cannot read"),
    ],
)
def test_the_train_job_refuses_bad_episode_fields(
    capable_champion: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fields: dict[str, Any],
    words: str,
) -> None:
    dataset = tmp_path / "tasks.jsonl"
    write_task_file(dataset, v1_tasks())
    code = run_train_job(
        tmp_path, algorithm="rft", dataset=dataset, base_checkpoint=capable_champion, **fields
    )
    assert code == 2
    assert words in capsys.readouterr().err


def test_a_probe_keeps_its_failures_too(
    capable_champion: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = ToolcalcEnvironment()
    dataset = tmp_path / "probe-tasks.jsonl"
    write_task_file(dataset, env.generate_tasks(2, seed=32, api_version="v3"))  # never solved
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "schema": "ratchet.job/v1",
                "kind": "eval",
                "run_id": "probe-1",
                "seed": 0,
                "device": "cpu",
                "checkpoint": str(capable_champion),
                "dataset": str(dataset),
                "output_dir": str(tmp_path / "out"),
                "samples": 3,
                "keep_episodes": 2,
                "hyperparameters": {"temperature": 1.0, "max_new_tokens": 48, "probes": 0},
            }
        )
    )
    assert eval_job_main(["--spec", str(spec)]) == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    kept = read_listed_episodes(tmp_path / "out", metrics)
    failures = [r for r in kept if not r.passed]
    assert failures, "v3 tasks fail for a champion never shown v3"
    for task_hash in {r.task_id for r in kept}:
        assert sum(r.task_id == task_hash for r in failures) <= 2
    assert metrics["episode_file"]["kinds"] == sorted({r.kind for r in kept})

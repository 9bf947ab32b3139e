"""Chained profiles: ``["rft", "grpo"]`` runs both stages, each from the previous stage's
weights, and metrics.json says what each saw and did; the chain's keys are split by stage
and every bad one is refused by name, at the api's door and in the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.loop.policies import TrainingProfile
from services.training.checkpoint import read_manifest
from services.training.config import (
    GRPOConfig,
    HyperparameterError,
    RFTConfig,
    parse_chain,
    stage_hyperparameters,
)
from services.training.family import family_for
from tests.services.training.conftest import read_metrics, run_train_job

RFT_KEYS = {"rft.samples_per_task": 2, "rft.steps": 2, "rft.batch_size": 4}
SHARED = {"max_new_tokens": 48, "log_every": 0}
GRPO_KEYS = {"tasks_per_step": 2, "group_size": 2, "checkpoint_every": 0}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chain") / "tasks.jsonl"
    write_task_file(path, ToolcalcEnvironment().generate_tasks(4, seed=31, api_version="v1"))
    return path


def weights(checkpoint: Path) -> list[torch.Tensor]:
    model = family_for("tiny").load(checkpoint, device=torch.device("cpu"))
    return [p.detach() for _, p in model.trainable_parameters()]


def test_a_chained_profile_runs_both_stages(
    capable_champion: Path, dataset: Path, tmp_path: Path
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm=["rft", "grpo"],
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=capable_champion,
        hyperparameters={**RFT_KEYS, **SHARED, **GRPO_KEYS, "grpo.steps": 2},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    rft, grpo = metrics["stages"]
    assert metrics["algorithm"] == ["rft", "grpo"]
    assert (rft["stage"], rft["algorithm"], grpo["stage"], grpo["algorithm"]) == (
        1,
        "rft",
        2,
        "grpo",
    )
    assert rft["episodes"] == 8 and rft["successes"] > 0 and rft["trained"] is True
    assert rft["steps"] == 2 and rft["final_loss"] is not None
    assert rft["hyperparameters"]["steps"] == 2 and rft["hyperparameters"]["max_new_tokens"] == 48
    assert grpo["steps"] == 2 and grpo["episodes"] == 2 * 2 * 2 and len(grpo["history"]) == 2
    assert grpo["successes"] == sum(row["successes"] for row in grpo["history"])
    assert grpo["hyperparameters"]["steps"] == 2 and grpo["hyperparameters"]["group_size"] == 2
    assert metrics["steps"] == 4 and metrics["episodes"] == 8 + 8
    assert metrics["train_tokens"] == rft["train_tokens"] + grpo["train_tokens"]
    manifest = read_manifest(tmp_path / "out" / "checkpoint")
    assert manifest.metadata["algorithm"] == ["rft", "grpo"]


def test_each_stage_starts_from_the_previous_stage_weights(
    capable_champion: Path, dataset: Path, tmp_path: Path
) -> None:
    """rft then a GRPO stage of no step ends where rft alone ends, and not at the champion."""
    chained = {**RFT_KEYS, **SHARED, **GRPO_KEYS, "grpo.steps": 0}
    alone = {key.removeprefix("rft."): value for key, value in {**RFT_KEYS, **SHARED}.items()}
    for name, algorithm, hyper in (
        ("chain", ["rft", "grpo"], chained),
        ("rft", "rft", alone),
    ):
        code = run_train_job(
            tmp_path / name,
            algorithm=algorithm,
            environment="toolcalc",
            dataset=dataset,
            base_checkpoint=capable_champion,
            hyperparameters=hyper,
        )
        assert code == 0
    chain_weights = weights(tmp_path / "chain" / "out" / "checkpoint")
    rft_weights = weights(tmp_path / "rft" / "out" / "checkpoint")
    assert all(torch.equal(a, b) for a, b in zip(chain_weights, rft_weights, strict=True))
    champion = weights(capable_champion)
    assert not all(torch.equal(a, b) for a, b in zip(chain_weights, champion, strict=True))


def test_chain_keys_split_by_stage() -> None:
    split = stage_hyperparameters(
        "tiny", ("rft", "grpo"), {"rft.steps": 3, "steps": 5, "group_size": 4, "threads": 1}
    )
    assert split == [{"steps": 3, "threads": 1}, {"steps": 5, "group_size": 4, "threads": 1}]
    rft, grpo = parse_chain("tiny", ["rft", "grpo"], {"rft.steps": 3, "grpo.steps": 5}, seed=2)
    assert isinstance(rft.config, RFTConfig) and isinstance(grpo.config, GRPOConfig)
    assert (rft.config.steps, grpo.config.steps, rft.config.seed) == (3, 5, 2)
    (single,) = parse_chain("tiny", "grpo", {"steps": 7})
    assert isinstance(single.config, GRPOConfig) and single.config.steps == 7


@pytest.mark.parametrize(
    ("family", "algorithm", "raw", "key", "message"),
    [
        ("tiny", ["rft", "grpo"], {"dpo.beta": 0.1}, "dpo.beta", "not a stage of the chain"),
        ("tiny", ["rft", "grpo"], {"rft.beta": 0.1}, "rft.beta", "unknown hyperparameter 'beta'"),
        ("tiny", ["rft", "grpo"], {"beta": 0.1}, "beta", "no stage of ['rft', 'grpo'] takes it"),
        ("tiny", ["rft", "grpo"], {"grpo.group_size": 1}, "group_size", "group_size must be >= 2"),
        ("hf", ["rft", "grpo"], {"rft.lora_r": 4}, "lora_r", "same in every stage"),
        ("tiny", ["rft", "ppo"], {}, None, "unknown algorithm 'ppo'"),
        ("tiny", [], {}, None, "non-empty list"),
    ],
)
def test_bad_chains_are_refused_by_name(
    family: str, algorithm: object, raw: dict[str, object], key: str | None, message: str
) -> None:
    with pytest.raises(HyperparameterError) as refused:
        parse_chain(family, algorithm, raw)
    assert refused.value.key == key and message in refused.value.message


def test_a_profile_accepts_a_chain_and_refuses_an_unknown_algorithm() -> None:
    profile = TrainingProfile.model_validate(
        {"algorithm": ["rft", "grpo"], "hyperparameters": {"rft.steps": 3, "steps": 5}}
    )
    assert profile.algorithm == ["rft", "grpo"]
    assert TrainingProfile.model_validate({}).algorithm == "grpo"
    assert TrainingProfile.model_validate({"algorithm": "dpo"}).algorithm == "dpo"
    for bad, location, text in (
        ({"algorithm": "ppo"}, ("algorithm",), "unknown algorithm 'ppo'"),
        ({"algorithm": ["rft", "ppo"]}, ("algorithm",), "unknown algorithm 'ppo'"),
        ({"algorithm": []}, ("algorithm",), "non-empty list"),
        (
            {"algorithm": ["rft", "grpo"], "hyperparameters": {"dpo.beta": 1}},
            ("hyperparameters", "dpo.beta"),
            "not a stage",
        ),
    ):
        with pytest.raises(ValidationError) as refused:
            TrainingProfile.model_validate(bad)
        (error,) = refused.value.errors()
        assert error["loc"] == location and text in error["msg"]


def test_a_job_with_a_bad_chain_fails_with_one_clear_line(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_train_job(
        tmp_path, algorithm=["rft", "ppo"], environment="toolcalc", dataset=dataset
    )
    assert code != 0
    assert "unknown algorithm 'ppo'" in capsys.readouterr().err

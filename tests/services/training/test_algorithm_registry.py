"""Adding an algorithm is one module and one registry entry (docs/design.md, "Adding an
algorithm"): a second, test-only algorithm registered here runs through the same train job
entry point the loop's executors start, alone and in a chain, and the loop profile's check
knows it without another change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.training.checkpoint import load_checkpoint
from services.training.config import (
    ALGORITHMS,
    Algorithm,
    HyperparameterError,
    SFTConfig,
    parse_chain,
)
from services.training.family import DemonstrationOptions
from services.training.sft import train_sft
from services.training.stages import StageResult, StageRun
from tests.services.training.conftest import read_metrics, run_train_job

NAME = "sft_once"
ONE_STEP = Algorithm(
    configs={"tiny": SFTConfig},
    job_options={"tiny": frozenset({"threads"})},
    trainer=f"{__name__}:one_sft_step",
)


def one_sft_step(run: StageRun) -> StageResult:
    """The test-only algorithm: one SFT step on the demonstration of the first task."""
    config = run.hyper.config
    assert isinstance(config, SFTConfig)
    demonstration = run.model.demonstrations(
        run.env, run.tasks[:1], DemonstrationOptions(seed=config.seed)
    )
    counters = train_sft(
        run.model, demonstration, replace(config, steps=1, batch_size=1), ctx=run.ctx
    )
    metrics = {
        **counters.metrics(),
        "final_loss": counters.final_loss,
        "final_reward": None,
        "final_pass_rate": None,
        "demonstrations": len(demonstration),
        "hyperparameters": config.to_dict(),
    }
    return StageResult(metrics, counters.phase_s)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ALGORITHMS, NAME, ONE_STEP)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(checkpoint).state_dict


@pytest.mark.usefixtures("registered")
def test_a_registered_algorithm_runs_through_the_train_job(
    tmp_path: Path, tiny_champion: Path, task_files: dict[str, Path]
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm=NAME,
        environment="toolcalc",
        dataset=task_files["v1"],
        base_checkpoint=tiny_champion,
        hyperparameters={"lr": 1e-2},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["algorithm"] == NAME and metrics["steps"] == 1
    assert metrics["demonstrations"] == 1 and metrics["hyperparameters"]["lr"] == 1e-2
    trained = tmp_path / "out" / "checkpoint"
    base_id = load_checkpoint(tiny_champion).manifest.checkpoint_id
    assert load_checkpoint(trained).manifest.parent == base_id
    before, after = _weights(tiny_champion), _weights(trained)
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.usefixtures("registered")
def test_a_registered_algorithm_is_a_stage_of_a_chain(
    tmp_path: Path, tiny_champion: Path, task_files: dict[str, Path]
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm=[NAME, NAME],
        environment="toolcalc",
        dataset=task_files["v1"],
        base_checkpoint=tiny_champion,
        hyperparameters={f"{NAME}.lr": 1e-2},
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["steps"] == 2
    assert [stage["algorithm"] for stage in metrics["stages"]] == [NAME, NAME]


@pytest.mark.usefixtures("registered")
def test_the_profile_check_knows_a_registered_algorithm() -> None:
    (checked,) = parse_chain("tiny", NAME, {"lr": 0.5, "threads": 1})
    assert isinstance(checked.config, SFTConfig) and checked.config.lr == 0.5
    with pytest.raises(HyperparameterError, match="no trainer for the hf family"):
        parse_chain("hf", NAME, {})
    with pytest.raises(HyperparameterError, match="augment_fraction"):
        parse_chain("tiny", NAME, {"augment_fraction": 0.5})


def test_an_unregistered_algorithm_is_refused_by_name() -> None:
    with pytest.raises(HyperparameterError, match=f"unknown algorithm '{NAME}'"):
        parse_chain("tiny", NAME, {})


@pytest.mark.usefixtures("registered")
def test_a_registered_algorithm_needs_a_base_unless_it_starts_from_scratch(
    tmp_path: Path, task_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_train_job(tmp_path, algorithm=NAME, environment="toolcalc", dataset=task_files["v1"])
    assert code != 0
    assert f"{NAME} needs a base checkpoint" in capsys.readouterr().err


def test_a_trainer_the_registry_cannot_import_fails_the_job_with_its_name(
    tmp_path: Path,
    tiny_champion: Path,
    task_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(ALGORITHMS, NAME, replace(ONE_STEP, trainer="tests.no_such_module:f"))
    code = run_train_job(
        tmp_path,
        algorithm=NAME,
        environment="toolcalc",
        dataset=task_files["v1"],
        base_checkpoint=tiny_champion,
    )
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import tests.no_such_module:f" in err[0]

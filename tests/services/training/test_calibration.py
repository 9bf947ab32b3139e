"""The calibration pass (services.training.calibration): the train job, shortened, timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.environments.toolcalc import ToolcalcEnvironment
from services.training.calibration import CALIBRATION_STEPS, calibration_plan, calibration_tasks
from services.training.config import parse_chain
from tests.services.training.conftest import read_metrics, run_train_job


def test_the_plan_keeps_the_shapes_and_cuts_the_steps_rounds_and_tasks() -> None:
    rft, grpo = parse_chain(
        "tiny",
        ["rft", "grpo"],
        {
            "rft.samples_per_task": 16,
            "rft.rollout_batch": 64,
            "rft.iterations": 2,
            "rft.steps": 60,
            "grpo.steps": 40,
            "grpo.tasks_per_step": 8,
            "grpo.group_size": 16,
        },
    )
    tasks = ToolcalcEnvironment().generate_tasks(20, seed=1)
    (short_rft, short_grpo), kept = calibration_plan([rft, grpo], tasks)
    assert (short_rft.config.steps, short_rft.config.iterations) == (CALIBRATION_STEPS, 1)
    assert short_rft.config.samples_per_task == 16
    assert (short_grpo.config.steps, short_grpo.config.group_size) == (CALIBRATION_STEPS, 16)
    # one rollout batch of rft (64 / 16 = 4 tasks), one step of GRPO (8 tasks): 8
    assert calibration_tasks([rft, grpo]) == 8 and kept == tasks[:8]


def test_a_calibration_job_runs_the_job_shortened_and_times_its_phases(
    tiny_champion: Path, task_files: dict[str, Path], tmp_path: Path
) -> None:
    code = run_train_job(
        tmp_path,
        algorithm="rft",
        environment="toolcalc",
        dataset=task_files["v1"],
        base_checkpoint=tiny_champion,
        calibrate=True,
        hyperparameters={
            "samples_per_task": 2,
            "rollout_batch": 4,
            "iterations": 3,
            "steps": 50,
            "max_new_tokens": 16,
            "log_every": 0,
        },
    )
    assert code == 0
    metrics = read_metrics(tmp_path)
    assert metrics["calibration"] is True
    assert metrics["tasks"] == 2  # one rollout batch: 4 episodes of 2 tasks
    assert metrics["episodes"] == 4 and len(metrics["iterations"]) == 1
    assert metrics["steps"] <= CALIBRATION_STEPS
    assert {"rollout", "sync"} <= set(metrics["phases"])
    assert (tmp_path / "out" / "checkpoint" / "manifest.json").is_file()


def test_calibrate_must_be_a_flag(tmp_path: Path, task_files: dict[str, Path]) -> None:
    code = run_train_job(
        tmp_path,
        algorithm="sft",
        environment="toolcalc",
        dataset=task_files["v1"],
        calibrate="yes",
        hyperparameters={"steps": 1},
    )
    assert code != 0
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path)

"""A loop's own job image and command (training_profile.train_job / eval_job) reach the job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.executors.base import JobSpec, JobSpecError
from services.executors.kubernetes.builder import build_job
from services.executors.local import LocalExecutor
from services.loop.policies import TrainingProfile
from tests.services.executors.test_kubernetes_builder import assert_valid, container, template
from workflows.shared import job_override


def test_the_kubernetes_job_runs_the_loops_image_and_command(
    tmp_path: Path, make_spec: Callable[..., JobSpec]
) -> None:
    spec = make_spec(image="ghcr.io/acme/own-trainer:2.1", command=("python", "/app/train.py"))
    job = build_job(spec, template(tmp_path), namespace="ml")
    assert_valid(job)
    assert container(job)["image"] == "ghcr.io/acme/own-trainer:2.1"
    assert container(job)["command"] == [
        "python",
        "/app/train.py",
        "train",
        "--spec",
        str(spec.spec_path),
    ]
    # Without an override the template's image and command stay.
    default = build_job(make_spec(), template(tmp_path), namespace="ml")
    assert container(default)["image"] == "ghcr.io/acme/trainer:1.0"
    assert container(default)["command"][:2] == ["ratchet", "job"]


def test_the_local_executor_runs_the_loops_command(make_spec: Callable[..., JobSpec]) -> None:
    executor = LocalExecutor(command=["ratchet-default"])
    spec = make_spec(command=("/opt/trainer/bin/train", "--fast"), image="ignored:1")
    assert executor.job_command(spec) == [
        "/opt/trainer/bin/train",
        "--fast",
        "train",
        "--spec",
        str(spec.spec_path),
    ]
    assert executor.job_command(make_spec())[0] == "ratchet-default"


def test_bad_overrides_are_refused(make_spec: Callable[..., JobSpec]) -> None:
    with pytest.raises(JobSpecError, match="non-empty list"):
        make_spec(command=())
    with pytest.raises(JobSpecError, match="non-empty list"):
        make_spec(command=("python", ""))
    with pytest.raises(JobSpecError, match="image"):
        make_spec(image=" ")
    with pytest.raises(ValidationError) as refused:
        TrainingProfile.model_validate({"train_job": {"command": [], "imagee": "x"}})
    assert {e["loc"] for e in refused.value.errors()} == {
        ("train_job", "command"),
        ("train_job", "imagee"),
    }


def test_the_workflow_reads_the_override_from_the_profile() -> None:
    profile = TrainingProfile.model_validate(
        {"train_job": {"image": "img:1", "command": ["python", "t.py"]}}
    ).model_dump()
    assert job_override(profile, "train_job") == ("img:1", ["python", "t.py"])
    assert job_override(profile, "eval_job") == (None, None)
    assert job_override({}, "train_job") == (None, None)

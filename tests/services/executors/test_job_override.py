"""A loop's own job image and command (training_profile.train_job / eval_job) reach the job."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.cores import THREAD_VARIABLES, ThreadBudget, thread_budget, thread_env
from services.executors.base import JobRequest, JobRequestError
from services.executors.kubernetes.builder import build_job
from services.executors.local import LocalExecutor, job_environment, job_thread_env
from services.loop.policies import TrainingProfile
from tests.services.executors.test_kubernetes_builder import assert_valid, container, template
from tests.support import assert_eventually
from workflows.payloads.jobs import job_override


def test_the_kubernetes_job_runs_the_loops_image_and_command(
    tmp_path: Path, make_spec: Callable[..., JobRequest]
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


def test_the_local_executor_runs_the_loops_command(make_spec: Callable[..., JobRequest]) -> None:
    executor = LocalExecutor(command=["ratchet-default"], loop_commands_enabled=True)
    spec = make_spec(command=("/opt/trainer/bin/train", "--fast"), image="ignored:1")
    assert executor.job_command(spec) == [
        "/opt/trainer/bin/train",
        "--fast",
        "train",
        "--spec",
        str(spec.spec_path),
    ]
    assert executor.job_command(make_spec())[0] == "ratchet-default"


def test_bad_overrides_are_refused(make_spec: Callable[..., JobRequest]) -> None:
    with pytest.raises(JobRequestError, match="non-empty list"):
        make_spec(command=())
    with pytest.raises(JobRequestError, match="non-empty list"):
        make_spec(command=("python", ""))
    with pytest.raises(JobRequestError, match="image"):
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
    )
    assert job_override(profile.train_job) == ("img:1", ["python", "t.py"])
    assert job_override(profile.eval_job) == (None, None)
    assert job_override(TrainingProfile().train_job) == (None, None)


def test_the_local_executor_refuses_a_loops_command_unless_enabled(
    make_spec: Callable[..., JobRequest],
) -> None:
    """The executor is the last line: a loop saved before the deployment said no (or written
    to the database directly) still does not run its command on the worker's machine."""
    spec = make_spec(command=(sys.executable, "-c", "print('ran')"))
    with pytest.raises(JobRequestError, match="RATCHET_LOCAL_JOB_COMMANDS_ENABLED") as refused:
        LocalExecutor().submit(spec)
    assert not refused.value.retryable
    assert not (spec.output_dir).exists()  # nothing started
    # The deployment's own command (the executor's) is not the loop's: it runs.
    assert LocalExecutor(command=["ratchet-default"]).job_command(make_spec())[0] == (
        "ratchet-default"
    )


DUMP_ENV = """
import json, os, pathlib
out = pathlib.Path(os.environ["RATCHET_OUTPUT_DIR"])
(out / "env.json").write_text(json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}))
(out / "metrics.json").write_text("{}")
"""


def test_a_local_job_gets_an_allow_list_of_the_workers_environment(
    make_spec: Callable[..., JobRequest], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in {
        "RATCHET_ADMIN_TOKEN": "admin-secret",
        "RATCHET_SECRET_KEY": "fernet-secret",
        "RATCHET_DATABASE_URL": "postgresql://u:p@h/db",
        "RATCHET_SERVE_API_KEY": "serve-secret",
        "AWS_SECRET_ACCESS_KEY": "cloud-secret",
        "HF_TOKEN": "hub-secret",
        "OMP_NUM_THREADS": "1",
        "LC_ALL": "C.UTF-8",
    }.items():
        monkeypatch.setenv(name, value)
    executor = LocalExecutor(
        command=[sys.executable, "-c", DUMP_ENV], loop_commands_enabled=True, poll_interval_s=0.05
    )
    spec = make_spec(image="ghcr.io/acme/trainer:1")
    handle = executor.submit(spec)

    def succeeded() -> None:
        assert executor.status(handle).state == "succeeded"

    assert_eventually(succeeded, timeout=60)
    seen = json.loads((spec.output_dir / "env.json").read_text())
    env = seen["env"]
    for secret in ("admin-secret", "fernet-secret", "u:p@h", "serve-secret", "cloud-secret"):
        assert secret not in json.dumps(env)
    assert "HF_TOKEN" not in env
    assert env["LC_ALL"] == "C.UTF-8"
    # The thread variables are the job's share of the machine, whatever the worker's were.
    assert env["OMP_NUM_THREADS"] == str(thread_budget().job)
    assert env["RATCHET_OUTPUT_DIR"] == str(spec.output_dir)
    assert set(env) - set(job_environment(os.environ)) <= {
        "RATCHET_JOB_SPEC",
        "RATCHET_OUTPUT_DIR",
        "RATCHET_RUN_ID",
        "RATCHET_DATASET",
        "RATCHET_BASE_CHECKPOINT",
        "PWD",
        "_",
        *THREAD_VARIABLES,
    }
    # It works in its run directory, never the state dir; the ignored image is in its log.
    assert Path(seen["cwd"]) == spec.run_dir
    log = executor.logs(handle)
    assert "ignores the job image 'ghcr.io/acme/trainer:1'" in log.splitlines()[0]


def test_a_local_jobs_threads_are_its_setting_else_the_loops_env_else_its_share(
    make_spec: Callable[..., JobRequest],
) -> None:
    budget = ThreadBudget(8)
    share = make_spec()
    assert job_thread_env(share, budget)["OMP_NUM_THREADS"] == "4"  # the server keeps 4
    loop_env = make_spec(env={"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"})
    assert job_thread_env(loop_env, budget)["OMP_NUM_THREADS"] == "3"
    own = make_spec(env={"OMP_NUM_THREADS": "3"}, document={"hyperparameters": {"threads": 2}})
    assert job_thread_env(own, budget) == thread_env(2)


def test_a_started_local_job_gets_its_threads_setting_in_its_environment(
    make_spec: Callable[..., JobRequest],
) -> None:
    executor = LocalExecutor(
        command=[sys.executable, "-c", DUMP_ENV], loop_commands_enabled=True, poll_interval_s=0.05
    )
    spec = make_spec(document={"hyperparameters": {"threads": 3}})
    handle = executor.submit(spec)

    def succeeded() -> None:
        assert executor.status(handle).state == "succeeded"

    assert_eventually(succeeded, timeout=60)
    env = json.loads((spec.output_dir / "env.json").read_text())["env"]
    assert {name: env[name] for name in THREAD_VARIABLES} == thread_env(3)

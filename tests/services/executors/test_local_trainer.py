"""The local executor running the real reference trainer job (``services.training.job``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.environments.base import write_task_file
from services.environments.registry import get_environment
from services.executors.base import JobRequest, JobStatus
from services.executors.local import LocalExecutor
from services.training.checkpoint import verify_checkpoint
from tests.support import assert_eventually

TINY_MODEL = {"n_layer": 1, "n_head": 1, "d_model": 16}


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "artifacts" / "datasets" / "train.jsonl"
    write_task_file(path, get_environment("toolcalc").generate_tasks(4, seed=0, api_version="v1"))
    return path


def sft_spec(
    make_spec: Callable[..., JobRequest], dataset: Path, steps: int, **kw: Any
) -> JobRequest:
    document = {
        "algorithm": "sft",
        "environment": "toolcalc",
        "device": "cpu",
        "seed": 0,
        "hyperparameters": {
            "steps": steps,
            "batch_size": 2,
            "warmup": 1,
            "log_every": 1,
            "threads": 1,
            "model": TINY_MODEL,
        },
    }
    return make_spec(document=document, dataset=str(dataset), **kw)


def run_to_end(executor: LocalExecutor, handle: dict[str, Any]) -> JobStatus:
    status = executor.wait(handle, 60)
    while not status.terminal:
        status = executor.wait(handle, 60)
    return status


def test_the_trainer_job_runs_to_a_verified_checkpoint(
    make_spec: Callable[..., JobRequest], dataset: Path
) -> None:
    spec = sft_spec(make_spec, dataset, steps=2)
    executor = LocalExecutor(poll_interval_s=0.1)

    handle = executor.submit(spec)
    status = run_to_end(executor, handle)

    assert status.state == "succeeded", status.describe()
    # Its hyperparameters.threads is 1: torch ran on one intra-op and one inter-op thread.
    assert "torch threads: 1 intra-op, 1 inter-op" in executor.logs(handle)
    assert status.cpu_seconds > 0
    metrics = json.loads((spec.output_dir / "metrics.json").read_text())
    assert metrics["run_id"] == spec.run_id
    assert metrics["steps"] == 2
    manifest = verify_checkpoint(spec.output_dir / "checkpoint")
    assert manifest.checkpoint_id == metrics["checkpoint_id"]


def test_the_trainer_job_can_be_cancelled(
    make_spec: Callable[..., JobRequest], dataset: Path
) -> None:
    spec = sft_spec(make_spec, dataset, steps=1_000_000)
    executor = LocalExecutor(poll_interval_s=0.1, cancel_grace_s=20)
    handle = executor.submit(spec)
    # Cancel once it is really training (it logs every step).
    assert_eventually(lambda: _assert_in_log(executor, handle, "step"), timeout=60)

    executor.cancel(handle)

    status = executor.status(handle)
    assert status.state == "cancelled"
    assert not (spec.output_dir / "metrics.json").exists()
    assert not (spec.output_dir / "checkpoint" / "manifest.json").exists()


def _assert_in_log(executor: LocalExecutor, handle: dict[str, Any], text: str) -> None:
    assert text in executor.logs(handle)


def test_a_bad_trainer_spec_is_a_config_error(
    make_spec: Callable[..., JobRequest], dataset: Path
) -> None:
    spec = make_spec(document={"algorithm": "ppo", "environment": "toolcalc"}, dataset=str(dataset))
    executor = LocalExecutor(poll_interval_s=0.1)

    status = run_to_end(executor, executor.submit(spec))

    assert (status.state, status.config_error) == ("failed", True)
    assert status.message is not None and "unknown algorithm 'ppo'" in status.message

"""A tiny toolcalc champion shared by the training and evaluation job tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment

TINY_MODEL = {"d_model": 32, "n_layer": 2, "n_head": 2, "max_seq_len": 160}


def write_spec(path: Path, **fields: Any) -> Path:
    spec = {"schema": "ratchet.job/v1", "run_id": "test-run", "seed": 0, "device": "cpu", **fields}
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture(scope="session")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tasks")
    env = ToolcalcEnvironment()
    files = {}
    for version, n in (("v1", 64), ("v2", 32)):
        files[version] = root / f"{version}.jsonl"
        write_task_file(files[version], env.generate_tasks(n, seed=11, api_version=version))
    return files


@pytest.fixture(scope="session")
def tiny_champion(tmp_path_factory: pytest.TempPathFactory, task_files: dict[str, Path]) -> Path:
    """A tiny policy SFT'd for a few steps through the real train job (sft)."""
    from services.training.job import train_job_main

    root = tmp_path_factory.mktemp("champion")
    spec = write_spec(
        root / "spec.json",
        kind="train",
        algorithm="sft",
        environment="toolcalc",
        dataset=str(task_files["v1"]),
        output_dir=str(root / "out"),
        hyperparameters={
            "steps": 40,
            "batch_size": 16,
            "lr": 3e-3,
            "log_every": 0,
            "model": TINY_MODEL,
        },
    )
    assert train_job_main(["--spec", str(spec)]) == 0
    return root / "out" / "checkpoint"

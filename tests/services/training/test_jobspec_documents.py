"""The job spec is written in one place: what the workflows and the demo hand to a job."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from services.executors.base import JOB_SCHEMA as EXECUTOR_SCHEMA
from services.loop.policies import TrainingProfile
from services.training.jobspec import (
    JOB_SCHEMA,
    eval_job_document,
    job_environment,
    load_spec,
    train_job_document,
)


def test_train_document_applies_the_profile_and_moves_the_seed_with_the_cycle() -> None:
    document = train_job_document(
        run_id="loop-c3-train",
        environment="toolcalc",
        dataset="/data/train.jsonl",
        base_checkpoint="/ckpt/champion",
        profile=TrainingProfile(
            algorithm="sft", hyperparameters={"steps": 5}, seed=10, nodes=2
        ).model_dump(mode="json"),
        cycle=3,
    )
    assert document == {
        "schema": "ratchet.job/v1",
        "kind": "train",
        "run_id": "loop-c3-train",
        "algorithm": "sft",
        "environment": "toolcalc",
        "dataset": "/data/train.jsonl",
        "base_checkpoint": "/ckpt/champion",
        "hyperparameters": {"steps": 5},
        "seed": 13,
        "device": "auto",
        "nodes": 2,
    }


def test_train_document_takes_the_profiles_defaults_and_no_base() -> None:
    document = train_job_document(
        run_id="r",
        environment="toolcalc",
        dataset="/d.jsonl",
        profile=TrainingProfile().model_dump(mode="json"),
    )
    assert "base_checkpoint" not in document
    assert (document["algorithm"], document["seed"], document["nodes"]) == ("grpo", 0, 1)
    assert document["hyperparameters"] == {}


def test_eval_document_samples_only_when_asked(tmp_path: Path) -> None:
    document = partial(
        eval_job_document,
        run_id="e-1",
        environment="toolcalc",
        checkpoint="/ckpt",
        dataset="/tasks.jsonl",
        samples=4,
        seed=2,
    )
    assert "hyperparameters" not in document()
    sampled = document(temperature=0.7)
    assert sampled["hyperparameters"] == {"temperature": 0.7}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(sampled))
    loaded = load_spec(str(path), job_environment({"RATCHET_OUTPUT_DIR": "/out"}), kind="eval")
    assert (loaded.run_id, loaded.checkpoint, loaded.seed) == ("e-1", Path("/ckpt"), 2)


def test_one_schema_for_job_and_executor() -> None:
    assert EXECUTOR_SCHEMA is JOB_SCHEMA

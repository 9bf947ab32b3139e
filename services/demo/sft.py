"""The SFT recipe both demo champions are made with (the tiny one in
services/demo/champion.py, the real LM's in services/demo/smollm2.py): solved toolcalc v1
tasks, the SFT train job run on them through the job contract, the result kept per recipe.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from services.demo.jobs import run_job
from services.demo.options import Printer
from services.loop.policies import TrainingProfile
from services.training.jobspec import train_job_document


def champion_work_dir(cache: Path, prefix: str, made_from: list[Any]) -> Path:
    """Where a champion made from ``made_from`` (its SFT settings, JSON) is kept: one
    directory per distinct recipe, so a changed setting never reuses a stale champion."""
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    return cache / f"{prefix}-{key}"


def champion_from_v1_demonstrations(
    work: Path,
    *,
    name: str,
    task_count: int,
    run_id: str,
    hyperparameters: dict[str, Any],
    announce: str,
    out: Printer,
    base_checkpoint: str | None = None,
) -> Path:
    """The checkpoint directory of the champion kept in ``work`` (``name`` in what it
    prints), made first if it is not there: ``task_count`` solved toolcalc v1 tasks written
    into ``work``, ``announce`` said (``{n}``: the task count), and the SFT train job run on
    them there."""
    checkpoint = work / "output" / "checkpoint"
    if (checkpoint / "manifest.json").exists():
        out(f"[demo] reusing the {name} made earlier: {checkpoint}")
        return checkpoint
    from services.environments import get_environment, write_task_file

    tasks = get_environment("toolcalc").generate_tasks(task_count, seed=1, api_version="v1")
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "sft-v1.jsonl"
    write_task_file(dataset, tasks)
    out(announce.format(n=len(tasks)))
    started = time.monotonic()
    spec = train_job_document(
        run_id=run_id,
        environment="toolcalc",
        dataset=str(dataset),
        base_checkpoint=base_checkpoint,
        # Constructed, not validated: the job checks the hyperparameters against the family
        # of the checkpoint it trains (an hf one for smollm2); the profile gives the defaults.
        profile=TrainingProfile.model_construct(
            algorithm="sft", hyperparameters=hyperparameters
        ).model_dump(mode="json"),
    )
    run_job("train", spec, work, out)
    out(f"[demo] {name} ready in {time.monotonic() - started:.0f}s")
    return checkpoint

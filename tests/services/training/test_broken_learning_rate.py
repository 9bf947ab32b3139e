"""A trainer run with a broken learning rate never becomes the champion.

Two ways a learning rate breaks a run, both through the real train and eval jobs:

- one that makes the loss or gradient NaN or infinite: the job stops with one line saying
  so before the optimizer writes it into the weights, and writes no checkpoint;
- one high enough to wreck the weights while every number stays finite: the job "succeeds",
  and the gate, fed the eval job's per-task results, refuses the candidate because its
  regression suite collapsed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.environments import write_task_file
from services.environments.toolcalc import ToolcalcEnvironment
from services.evaluation.gate import decide
from services.evaluation.job import eval_job_main
from services.evaluation.results import read_results
from services.loop.policies import GatePolicy
from services.training.optim import TrainingDiverged, clip_and_check
from tests.services.training.conftest import run_train_job, write_spec


def grpo(root: Path, champion: Path, dataset: Path, *, lr: float) -> tuple[int, Path]:
    """GRPO from ``champion``: the job's exit code and its output directory."""
    code = run_train_job(
        root / "grpo",
        algorithm="grpo",
        environment="toolcalc",
        dataset=dataset,
        base_checkpoint=champion,
        hyperparameters={
            "steps": 3,
            "tasks_per_step": 4,
            "group_size": 4,
            "lr": lr,
            "checkpoint_every": 0,
            "log_every": 0,
        },
    )
    return code, root / "grpo" / "out"


def passes(root: Path, name: str, checkpoint: Path, tasks: Path) -> dict[str, bool]:
    """Per-task greedy results of the real eval job, by task id."""
    spec = write_spec(
        root / f"{name}.json",
        kind="eval",
        environment="toolcalc",
        dataset=str(tasks),
        checkpoint=str(checkpoint),
        output_dir=str(root / name),
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    return {row["task_id"]: bool(row["passed"]) for row in read_results(root / name)}


def test_a_non_finite_gradient_stops_training_before_the_weights_change() -> None:
    model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[float("inf"), 1.0]])).sum().backward()
    with pytest.raises(TrainingDiverged, match=r"diverged at step 7: .*learning rate 0.5"):
        clip_and_check(model, max_norm=1.0, step=6, lr=0.5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_candidate_wrecked_by_its_learning_rate_is_rejected_by_the_gate(
    tmp_path: Path, capable_champion: Path
) -> None:
    env = ToolcalcEnvironment()
    probe = tmp_path / "v1-probe.jsonl"
    write_task_file(probe, env.generate_tasks(96, seed=21, api_version="v1"))
    champion_v1 = passes(tmp_path, "champion-v1", capable_champion, probe)
    # The regression suite is what the champion handles, as curation pins sampled successes.
    suite = [t for t in env.generate_tasks(96, seed=21, api_version="v1") if champion_v1[t.task_id]]
    assert len(suite) >= 10, f"the champion passes only {len(suite)} of 96 v1 tasks"
    regression = tmp_path / "regression.jsonl"
    write_task_file(regression, suite)
    evaluation = tmp_path / "eval.jsonl"
    write_task_file(evaluation, env.generate_tasks(48, seed=22, api_version="v1"))

    code, out = grpo(tmp_path, capable_champion, evaluation, lr=1.0)
    assert code == 0, "a finite but broken run still completes; judging it is the gate's job"
    candidate = out / "checkpoint"
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3

    eval_champion = passes(tmp_path, "champion-eval", capable_champion, evaluation)
    eval_candidate = passes(tmp_path, "candidate-eval", candidate, evaluation)
    reg_champion = passes(tmp_path, "champion-regression", capable_champion, regression)
    reg_candidate = passes(tmp_path, "candidate-regression", candidate, regression)
    ids, reg_ids = sorted(eval_champion), sorted(reg_champion)
    decision = decide(
        [eval_champion[i] for i in ids],
        [eval_candidate[i] for i in ids],
        [reg_champion[i] for i in reg_ids],
        [reg_candidate[i] for i in reg_ids],
        GatePolicy(confidence=0.95, regression_tolerance_points=2.0, min_discordant_pairs=0),
    )
    assert decision.decision == "reject"
    assert decision.reason.startswith("regression suite dropped ")
    regression_stats = decision.statistics["regression"]
    assert regression_stats["champion_rate"] == 1.0
    assert regression_stats["candidate_rate"] < 0.5

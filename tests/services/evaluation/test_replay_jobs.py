"""Replay tasks through the real jobs with an hf champion (a tiny random Llama): GRPO trains
on them and the eval job scores them, reference tasks by their rule and a judge-only task by
a real ``ratchet serve`` judge whose calls and cost the eval metrics report; where a rule
decides beside a judge, the metrics report how often the two agree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.artifacts import ArtifactStore
from services.checkpoints import install_checkpoint
from services.environments.base import TaskSpec, read_task_file, write_task_file
from services.environments.replay import ReplayEnvironment
from services.environments.replay.records import recorded_calls, write_store_file
from services.environments.replay.scoring import in_agreement_sample
from services.evaluation.job import eval_job_main
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.services.environments.judge_server import JudgeServer, grade_by
from tests.services.environments.replay_traces import USER, failing_trace
from tests.services.modelserver.conftest import ServeProcess
from tests.services.training.conftest import read_metrics, run_train_job, write_spec
from tests.services.training.hf_support import build_tiny_llama


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = ArtifactStore(tmp_path_factory.mktemp("store"))
    source = tmp_path_factory.mktemp("llama") / "model"
    build_tiny_llama(source)
    return install_checkpoint(source, store).target


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("judge")
    config = GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=4096)
    torch.manual_seed(3)
    save_checkpoint(GPT(config), config, root / "ckpt")
    server = ServeProcess(root / "ckpt", name="grader", log=root / "serve.log")
    yield f"{server.url}/v1"
    server.stop()


def _dataset(root: Path) -> Path:
    """Three reference tasks and one judge-only task, shipped with their tool store."""
    env = ReplayEnvironment()
    traces = [failing_trace(f"loan-{n}") for n in range(3)]
    for n, trace in enumerate(traces):
        trace["messages"][1] = {"role": "user", "content": f"{USER} (desk {n})"}
    policy = {"judge_endpoint": "grader", "judge_rubric": "Refuse holds for overdue patrons."}
    traces.append(
        failing_trace("loan-judge", reference_answer=None, metadata={}, ratchet={"policy": policy})
    )
    store = root / "tool_responses.jsonl"
    write_store_file(store, [call for trace in traces for call in recorded_calls(trace)])
    tasks = []
    for trace in traces:
        task = env.task_from_trace(trace)
        assert isinstance(task, TaskSpec)
        tasks.append(
            TaskSpec.from_json(
                {
                    **task.to_dict(),
                    "metadata": {**task.metadata, "ratchet": {"tool_store": str(store)}},
                }
            )
        )
    write_task_file(root / "tasks.jsonl", tasks)
    return root / "tasks.jsonl"


def test_grpo_trains_an_hf_champion_on_replay_tasks(champion: Path, tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "data")
    references = tmp_path / "references.jsonl"
    write_task_file(
        references, [t for t in read_task_file(dataset) if t.reference_answer is not None]
    )
    code = run_train_job(
        tmp_path / "train",
        algorithm="grpo",
        environment="replay",
        dataset=references,
        base_checkpoint=champion,
        hyperparameters={
            "steps": 1,
            "tasks_per_step": 2,
            "group_size": 2,
            "max_turns": 2,
            "max_new_tokens": 8,
            "lr": 1e-3,
            "log_every": 0,
        },
    )
    assert code == 0
    metrics = read_metrics(tmp_path / "train")
    assert metrics["steps"] == 1 and metrics["episodes"] == 4
    # The sandbox reports what nobody could answer, per task (a random model seldom calls a
    # tool at all; the counts' meaning is tested in test_replay_tools.py).
    assert isinstance(metrics["unanswerable_calls"], dict)
    assert all(
        c["episodes_unanswered"] <= c["episodes"] for c in metrics["unanswerable_calls"].values()
    )


def test_the_eval_job_scores_replay_tasks_and_reports_the_judge(
    champion: Path, judge_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = _dataset(tmp_path / "data")
    monkeypatch.setenv(
        "RATCHET_JUDGE_ENDPOINTS", json.dumps({"grader": {"url": judge_url, "timeout_s": 60}})
    )
    spec = write_spec(
        tmp_path / "spec.json",
        kind="eval",
        environment="replay",
        checkpoint=str(champion),
        dataset=str(dataset),
        output_dir=str(tmp_path / "out"),
        hyperparameters={"max_turns": 2, "max_new_tokens": 8},
    )
    assert eval_job_main(["--spec", str(spec)]) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 4
    components = sorted(tuple(row["components"]) for row in rows)
    assert components == [("answer",), ("answer",), ("answer",), ("judge",)]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    judged = next(row for row in rows if "judge" in row["components"])
    assert isinstance(metrics["unanswerable_calls"], dict)
    usage = metrics["judge"]["grader"]
    # An empty answer is failed without asking; any other is one call to the judge.
    assert usage["calls"] == (1 if judged["answer"] and judged["answer"].strip() else 0)


def test_a_judge_task_without_its_endpoint_fails_the_eval_job_clearly(
    champion: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = _dataset(tmp_path / "data")
    spec = write_spec(
        tmp_path / "spec.json",
        kind="eval",
        environment="replay",
        checkpoint=str(champion),
        dataset=str(dataset),
        output_dir=str(tmp_path / "out"),
        hyperparameters={"max_turns": 1, "max_new_tokens": 4},
    )
    assert eval_job_main(["--spec", str(spec)]) != 0
    assert "judge endpoint 'grader'" in capsys.readouterr().err


def test_the_eval_job_reports_how_often_the_judge_agrees_with_the_rule(
    champion: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reference tasks of a loop that names a judge: the facts rule scores every episode,
    and the judge is asked too on the sampled tasks; the metrics count both verdicts."""
    env = ReplayEnvironment()
    policy = {"judge_endpoint": "grader", "judge_rubric": "Refuse holds for overdue patrons."}
    tasks = []
    for n in range(12):
        trace = failing_trace(
            f"loan-{n}",
            reference_answer=f"Patron P-{n} has {n + 1} overdue loans.",
            metadata={},
            ratchet={"policy": policy},
        )
        trace["messages"][1] = {"role": "user", "content": f"{USER} (desk {n})"}
        task = env.task_from_trace(trace)
        assert isinstance(task, TaskSpec)
        tasks.append(task)
    sampled = sum(in_agreement_sample(task.task_id) for task in tasks)
    assert sampled > 0
    write_task_file(tmp_path / "tasks.jsonl", tasks)
    spec = write_spec(
        tmp_path / "spec.json",
        kind="eval",
        environment="replay",
        checkpoint=str(champion),
        dataset=str(tmp_path / "tasks.jsonl"),
        output_dir=str(tmp_path / "out"),
        hyperparameters={"max_turns": 1, "max_new_tokens": 8, "probes": 0},
    )
    with JudgeServer(grade_by("overdue")) as server:
        monkeypatch.setenv("RATCHET_JUDGE_ENDPOINTS", json.dumps({"grader": {"url": server.url}}))
        assert eval_job_main(["--spec", str(spec)]) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    agreement = metrics["judge_agreement"]["grader"]
    assert agreement["episodes"] == sampled and agreement["errors"] == 0
    assert agreement["share"] == agreement["agreed"] / sampled
    assert 0.0 <= agreement["ci_low"] <= agreement["share"] <= agreement["ci_high"] <= 1.0
    assert metrics["judge"]["grader"]["calls"] <= sampled

"""The ratchet.task/v1 task file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.environments import TaskFileError, TaskSpec, read_task_file, write_task_file
from services.environments.toolcalc import ToolcalcEnvironment


def test_round_trip(tmp_path: Path) -> None:
    tasks = ToolcalcEnvironment().generate_tasks(5, seed=1, api_version="v1")
    path = tmp_path / "tasks.jsonl"
    assert write_task_file(path, tasks) == 5
    lines = path.read_text().splitlines()
    assert all(json.loads(line)["schema"] == "ratchet.task/v1" for line in lines)
    assert read_task_file(path) == tasks
    assert TaskSpec.from_json(tasks[0].to_json()) == tasks[0]
    assert TaskSpec.from_json(json.loads(tasks[0].to_json())) == tasks[0]


def test_task_id_is_content_hash_without_metadata() -> None:
    def task(prompt: str, metadata: dict[str, int] | None = None) -> TaskSpec:
        verifier = {"reward_id": "r", "params": {}}
        return TaskSpec.create(
            environment="e", prompt=prompt, tools=[], verifier=verifier, metadata=metadata
        )

    a, b, c = task("p", {"source": 1}), task("p", {"source": 2}), task("q")
    assert a.task_id == b.task_id != c.task_id
    assert len(a.task_id) == 64


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"schema": "ratchet.task/v0"}', "line 2: schema must be 'ratchet.task/v1'"),
        ('["a list"]', "line 2: a task must be a JSON object"),
    ],
)
def test_bad_line_names_its_number(tmp_path: Path, line: str, message: str) -> None:
    good = ToolcalcEnvironment().generate_tasks(1, seed=1, api_version="v1")[0]
    path = tmp_path / "tasks.jsonl"
    path.write_text(good.to_json() + "\n" + line + "\n")
    with pytest.raises(TaskFileError, match=message):
        read_task_file(path)


def test_tampered_content_is_detected(tmp_path: Path) -> None:
    good = ToolcalcEnvironment().generate_tasks(1, seed=1, api_version="v1")[0]
    data = json.loads(good.to_json())
    data["reference_answer"] = "0"
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(TaskFileError, match=r"line 1: task_id .* does not match"):
        read_task_file(path)


def test_missing_field_and_missing_file(tmp_path: Path) -> None:
    good = json.loads(
        ToolcalcEnvironment().generate_tasks(1, seed=1, api_version="v1")[0].to_json()
    )
    del good["verifier"]
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n")
    with pytest.raises(TaskFileError, match="line 1: field 'verifier' must be a dict"):
        read_task_file(path)
    with pytest.raises(TaskFileError, match="cannot read task file"):
        read_task_file(tmp_path / "absent.jsonl")

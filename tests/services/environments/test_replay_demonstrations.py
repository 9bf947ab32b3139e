"""Demonstrations of replay tasks (bootstrap's SFT targets): a successful trace's
conversation replayed through the sandbox is the recorded conversation token for token under
an hf model's chat template, what cannot teach is refused with its reason, and the SFT train
job turns such tasks into a LoRA adapter over the base model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from services.environments import write_task_file
from services.environments.base import Rejection, TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.demonstrations import (
    demonstration_messages,
    replay_mismatch,
)
from services.training.checkpoint import read_manifest
from tests.services.curation.bootstrap_traces import ANSWER, success
from tests.services.environments.replay_traces import call, failing_trace, result
from tests.services.environments.test_replay_hf import _wire
from tests.services.training.conftest import run_train_job
from tests.services.training.hf_support import build_tiny_llama


def demonstration_task(trace: dict[str, Any]) -> TaskSpec:
    """The replay task of a successful trace with its conversation, as bootstrap builds it."""
    env = ReplayEnvironment()
    task = env.task_from_trace(trace)
    turns = demonstration_messages(trace)
    assert isinstance(task, TaskSpec) and isinstance(turns, list)
    replay = {**task.metadata["replay"], "demonstration": turns}
    return dataclasses.replace(task, metadata={**task.metadata, "replay": replay})


def test_the_demonstration_is_the_recorded_conversation_token_for_token(tmp_path: Path) -> None:
    from services.training.hf.model import HFModel

    build_tiny_llama(tmp_path / "base")
    model = HFModel.load(tmp_path / "base", device="cpu")
    trace = success(3)
    task = demonstration_task(trace)
    env = ReplayEnvironment()

    pairs = env.chat_demonstration(task)

    recorded = [_wire(m) for m in trace["messages"]]
    agent_at = [i for i, m in enumerate(recorded) if m["role"] == "assistant"]
    tools = env.chat_start(task, max_turns=1).tools
    assert len(pairs) == len(agent_at)
    for (messages, _), index in zip(pairs, agent_at, strict=True):
        prompt = model.render([m.to_openai() for m in messages], tools)
        assert model.encode(prompt) == model.encode(model.render(recorded[:index], tools))
    assert pairs[-1][1] == ANSWER
    assert replay_mismatch(env, task) is None


def test_a_task_curated_from_a_failure_has_no_demonstration() -> None:
    env = ReplayEnvironment()
    task = env.task_from_trace(failing_trace())
    assert isinstance(task, TaskSpec)
    with pytest.raises(ValueError, match="ratchet loop bootstrap"):
        env.chat_demonstration(task)
    with pytest.raises(ValueError, match="recovery_fraction"):
        env.chat_demonstration(demonstration_task(success(1)), recover_from_slip=True)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (
            lambda m: m.insert(4, {"role": "user", "content": "and one more thing"}),
            "later_user_turn",
        ),
        (lambda m: m.__setitem__(4, call("c2", "renew_loan", {})), "unknown_tool_call"),
        (lambda m: m.pop(5), "unanswered_tool_call"),
        (lambda m: m.pop(), "no_final_answer"),
    ],
)
def test_what_cannot_teach_is_refused_with_its_reason(change: Any, reason: str) -> None:
    trace = success(2)
    change(trace["messages"])
    refused = demonstration_messages(trace)
    assert isinstance(refused, Rejection) and refused.reason == reason


def test_a_conversation_the_sandbox_answers_differently_is_a_mismatch() -> None:
    """The same call twice with two results: the sandbox replays the first both times."""
    trace = success(4)
    arguments = {"patron_id": "P-204"}
    trace["messages"][4:4] = [
        call("c9", "patron_loans", arguments),
        result("c9", "patron_loans", '{"open": 0, "overdue": 0}'),
    ]
    mismatch = replay_mismatch(ReplayEnvironment(), demonstration_task(trace))
    assert mismatch is not None and "replays as" in mismatch


def test_the_sft_job_trains_a_lora_adapter_over_the_base_model(tmp_path: Path) -> None:
    base = build_tiny_llama(tmp_path / "base")
    dataset = tmp_path / "bootstrap.jsonl"
    write_task_file(dataset, [demonstration_task(success(n)) for n in range(3)])

    code = run_train_job(
        tmp_path / "job",
        algorithm="sft",
        environment="replay",
        dataset=dataset,
        base_checkpoint=tmp_path / "base",
        hyperparameters={"steps": 2, "batch_size": 2, "micro_batch": 2, "log_every": 0},
    )

    assert code == 0
    adapter = read_manifest(tmp_path / "job" / "out" / "checkpoint")
    assert adapter.kind == "lora" and adapter.base is not None
    assert adapter.base.checkpoint_id == base.checkpoint_id
    metrics = json.loads((tmp_path / "job" / "out" / "metrics.json").read_text())
    assert metrics["algorithm"] == "sft" and metrics["demonstrations"] >= 3

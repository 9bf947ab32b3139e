"""The toolcalc trace adapter: ratchet.trace/v1 in, TaskSpec or Rejection out."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from services.environments import Rejection, TaskSpec
from services.environments.base import build_trace
from services.environments.toolcalc import ToolcalcEnvironment, get_api


@pytest.fixture
def env() -> ToolcalcEnvironment:
    return ToolcalcEnvironment()


def failed_trace(version: str = "v2", request: str = "$pear*37") -> dict[str, Any]:
    """A production trace where the agent used the v1 names after the API moved on."""
    return {
        "schema": "ratchet.trace/v1",
        "external_id": "trace-1",
        "model_version": "champion-abc",
        "started_at": "2025-01-01T00:00:00Z",
        "ended_at": "2025-01-01T00:00:02Z",
        "tools": get_api(version).tool_specs(),
        "messages": [
            {"role": "system", "content": get_api(version).listing()},
            {"role": "user", "content": request},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": "get", "arguments": {"item": "pear"}}],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "name": "get",
                "content": "error: unknown tool get",
            },
            {"role": "assistant", "content": "999"},
        ],
        "outcome": {
            "success": False,
            "score": 0.0,
            "error": {"kind": "tool_error", "message": "x"},
        },
        "reference_answer": "123456",  # a wrong claim: must be ignored
        "metadata": {"environment": "toolcalc", "api_version": version},
    }


def test_good_trace_becomes_the_generated_task(env: ToolcalcEnvironment) -> None:
    task = env.task_from_trace(failed_trace())
    assert isinstance(task, TaskSpec)
    assert task.reference_answer == "444"  # recomputed, not the trace's claim
    assert task.task_id == env.make_task("$pear*37", "v2").task_id  # same content, same id
    assert task.metadata["source"] == {"external_id": "trace-1", "model_version": "champion-abc"}
    assert task.prompt == "tools: #plus(a,b) &times(a,b) @price(item)\nuser: $pear*37\n"


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_version_inferred_from_tools_without_metadata(
    env: ToolcalcEnvironment, version: str
) -> None:
    trace = failed_trace(version)
    trace["metadata"] = {}
    task = env.task_from_trace(trace)
    assert isinstance(task, TaskSpec)
    assert task.verifier["params"]["api_version"] == version


def test_simulated_episode_round_trips(env: ToolcalcEnvironment) -> None:
    task = env.make_task("$fig+$kiwi", "v3")
    episode = env.demonstration(task)
    trace = build_trace(task, episode, env.verify(task, episode), external_id="sim-1")
    again = env.task_from_trace(trace)
    assert isinstance(again, TaskSpec) and again.task_id == task.task_id


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda t: t["messages"].__setitem__(
                1, {"role": "user", "content": "what's the weather?"}
            ),
            "unverifiable_request",
        ),
        (
            lambda t: t["messages"].__setitem__(1, {"role": "user", "content": "$durian*3"}),
            "unknown_item",
        ),
        (
            lambda t: t["messages"].__setitem__(1, {"role": "user", "content": "17"}),
            "no_tool_needed",
        ),
        (
            lambda t: t.__setitem__("messages", [m for m in t["messages"] if m["role"] != "user"]),
            "no_user_message",
        ),
        (lambda t: t["metadata"].__setitem__("environment", "websearch"), "wrong_environment"),
        (lambda t: t["metadata"].__setitem__("api_version", "v7"), "unknown_api_version"),
        (lambda t: t["metadata"].__setitem__("api_version", "v1"), "api_version_mismatch"),
        (
            lambda t: (t.__setitem__("metadata", {}), t.__setitem__("tools", [{"name": "search"}])),
            "unknown_api_version",
        ),
        (lambda t: t.__setitem__("messages", "not a list"), "malformed_trace"),
        (lambda t: t.__setitem__("schema", "other/v9"), "unsupported_schema"),
    ],
)
def test_rejections(env: ToolcalcEnvironment, mutate: Any, reason: str) -> None:
    trace = copy.deepcopy(failed_trace())
    mutate(trace)
    result = env.task_from_trace(trace)
    assert isinstance(result, Rejection)
    assert result.reason == reason
    assert result.message


def test_non_object_trace_is_rejected(env: ToolcalcEnvironment) -> None:
    result = env.task_from_trace(["not", "a", "trace"])  # type: ignore[arg-type]
    assert isinstance(result, Rejection) and result.reason == "malformed_trace"


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_a_chat_agents_trace_becomes_the_task_it_was_asked(
    env: ToolcalcEnvironment, version: str
) -> None:
    """A chat agent's user asks in words ("What is the price of one pear times 37?"), as the
    hf family is prompted; curation reads the request back from them."""
    for task in env.generate_tasks(60, seed=9, api_version=version):
        episode = env.chat_start(task, max_turns=5)
        trace = {
            "messages": episode.openai_messages(),
            "tools": [tool["function"] for tool in episode.tools],
            "metadata": {"environment": "toolcalc", "api_version": version},
        }
        rebuilt = env.task_from_trace(trace)
        assert isinstance(rebuilt, TaskSpec), (episode.openai_messages()[1], rebuilt)
        assert rebuilt.task_id == task.task_id


@pytest.mark.parametrize(
    "question",
    ["What is love?", "What is 1 plus 2 plus 3?", "What is the price of one PEAR42 times 3?"],
)
def test_a_question_toolcalc_does_not_ask_is_rejected(
    env: ToolcalcEnvironment, question: str
) -> None:
    trace = failed_trace()
    trace["messages"][1] = {"role": "user", "content": question}
    rejection = env.task_from_trace(trace)
    assert isinstance(rejection, Rejection) and rejection.reason == "unverifiable_request"

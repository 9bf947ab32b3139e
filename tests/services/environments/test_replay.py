"""The replay environment: traces of a library-loans agent become tasks whose tools replay
the recorded results, and whose reward is the most trusted one the trace allows."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.chat.render import messages_with_tools_prompt
from services.environments import get_environment
from services.environments.base import Rejection, TaskSpec
from services.environments.registry import environment_names
from services.environments.replay import LiveToolEndpoint, ReplayEnvironment, ToolEndpointConfig
from services.environments.replay.env import openai_tools
from services.environments.replay.records import (
    RecordedCall,
    canonical_arguments,
    recorded_calls,
    schema_hash,
    write_store_file,
)
from tests.services.environments.replay_traces import (
    HOLD,
    HOLD_RESULT,
    LOANS,
    SEARCH,
    SEARCH_RESULT,
    SEARCH_V2,
    USER,
    failing_trace,
    hermes,
)


def task_of(trace: dict[str, Any], env: ReplayEnvironment | None = None) -> TaskSpec:
    task = (env or ReplayEnvironment()).task_from_trace(trace)
    assert isinstance(task, TaskSpec), task
    return task


def test_replay_is_a_built_in_environment() -> None:
    assert "replay" in environment_names()
    assert isinstance(get_environment("replay"), ReplayEnvironment)


def test_a_trace_becomes_a_task_of_its_conversation_and_tools() -> None:
    task = task_of(failing_trace())
    assert task.environment == "replay"
    assert task.tools == [SEARCH, HOLD, LOANS]
    assert USER in task.prompt and "Done!" not in task.prompt
    assert task.metadata["replay"]["messages"][-1] == {"role": "user", "content": USER}
    assert task.metadata["verifier_kind"] == "reference"
    assert task.verifier["params"]["reward"] == {
        "kind": "reference",
        "source": "trace",
        "match": {"rule": "regex"},
    }


def test_repeating_the_recorded_calls_reproduces_the_recorded_episode() -> None:
    trace = failing_trace()
    env = ReplayEnvironment()
    task = task_of(trace, env)
    episode = env.chat_start(task, max_turns=5)
    script = [
        hermes("search_catalog", {"title": "The Left Hand of Darkness"}),
        # Other key order and spacing: the same canonical call.
        hermes("place_hold", {"book_id": "B-77", "patron_id": "P-204"}),
        "Done! The hold is placed.",
    ]
    for completion in script:
        env.chat_step(task, episode, completion)
    assert episode.done and episode.end_reason == "answered"
    tool_replies = [m.content for m in episode.messages if m.role == "tool"]
    assert tool_replies == [SEARCH_RESULT, HOLD_RESULT]
    # Rendered for a chat template, the replayed conversation is the recorded one, byte for
    # byte, so any tokenizer gives the same tokens.
    recorded = [_wire(m) for m in trace["messages"]]
    replayed = [_wire(m) for m in episode.openai_messages()]
    tools = openai_tools(task.tools)
    assert messages_with_tools_prompt(replayed, tools) == messages_with_tools_prompt(
        recorded, tools
    )
    reward = env.chat_verify(task, episode)
    assert not reward.passed and reward.total == 0.0


def test_an_unrecorded_call_gets_the_no_recorded_result_error() -> None:
    env = ReplayEnvironment()
    task = task_of(failing_trace())
    assert env.tool_result(task, "patron_loans", {"patron_id": "P-204"}) == (
        "error: no recorded result for tool patron_loans with these arguments"
    )
    assert env.tool_result(task, "renew_loan", {}) == "error: unknown tool renew_loan"
    assert env.tool_result(task, "place_hold", {"book_id": "B-77"}) == (
        "error: place_hold is missing required argument(s) patron_id"
    )


def test_a_multi_turn_episode_that_recovers_passes() -> None:
    env = ReplayEnvironment()
    task = task_of(failing_trace())
    episode = env.chat_start(task, max_turns=5)
    env.chat_step(task, episode, hermes("search_catalog", {"title": "The Left Hand of Darkness"}))
    env.chat_step(task, episode, hermes("place_hold", {"book_id": "B-77", "patron_id": "P-204"}))
    env.chat_step(task, episode, "I could not place it: the patron has overdue loans.")
    assert env.chat_verify(task, episode).passed


def test_max_turns_ends_an_episode_that_keeps_calling() -> None:
    env = ReplayEnvironment()
    task = task_of(failing_trace())
    episode = env.chat_start(task, max_turns=2)
    for _ in range(2):
        env.chat_step(task, episode, hermes("patron_loans", {"patron_id": "P-204"}))
    assert episode.done and episode.end_reason == "max_turns"
    assert not env.chat_verify(task, episode).passed


def test_canonical_arguments_ignore_key_order_and_integral_floats() -> None:
    assert canonical_arguments({"b": 2.0, "a": "x"}) == canonical_arguments('{"a":"x","b":2}')
    assert canonical_arguments({"a": 2.5}) != canonical_arguments({"a": 2})
    assert canonical_arguments("not json") == "not json"


def test_results_recorded_in_other_traces_come_from_the_shipped_store(tmp_path: Path) -> None:
    env = ReplayEnvironment()
    task = task_of(failing_trace())
    other = RecordedCall(
        "patron_loans",
        schema_hash(LOANS),
        canonical_arguments({"patron_id": "P-204"}),
        '{"open": 2, "overdue": 3}',
    )
    store = tmp_path / "tool_responses.jsonl"
    write_store_file(store, [other])
    shipped = TaskSpec.from_json(
        {**task.to_dict(), "metadata": {**task.metadata, "ratchet": {"tool_store": str(store)}}}
    )
    assert env.tool_result(shipped, "patron_loans", {"patron_id": "P-204"}) == other.result
    missing = TaskSpec.from_json(
        {
            **task.to_dict(),
            "metadata": {
                "replay": task.metadata["replay"],
                "ratchet": {"tool_store": str(tmp_path / "gone")},
            },
        }
    )
    with pytest.raises(ValueError, match="cannot read tool-response store"):
        env.tool_result(missing, "patron_loans", {"patron_id": "P-204"})


def test_a_drifted_schema_keeps_its_own_tools_and_results_apart(tmp_path: Path) -> None:
    old = failing_trace()
    new = failing_trace("loan-2", tools=[SEARCH_V2, HOLD, LOANS])
    new["messages"][2] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "name": "search_catalog",
                "arguments": {"title": "The Left Hand of Darkness", "branch": "elm"},
            }
        ],
    }
    env = ReplayEnvironment()
    old_task, new_task = task_of(old, env), task_of(new, env)
    assert old_task.tools[0] == SEARCH and new_task.tools[0] == SEARCH_V2
    assert schema_hash(SEARCH) != schema_hash(SEARCH_V2)
    store = tmp_path / "store.jsonl"
    write_store_file(store, recorded_calls(old) + recorded_calls(new))
    shipped = TaskSpec.from_json(
        {
            **new_task.to_dict(),
            "metadata": {**new_task.metadata, "ratchet": {"tool_store": str(store)}},
        }
    )
    # The old schema's call is not the new tool's: the real tool would refuse it.
    assert env.tool_result(shipped, "search_catalog", {"title": "The Left Hand of Darkness"}) == (
        "error: search_catalog is missing required argument(s) branch"
    )
    assert (
        env.tool_result(
            shipped, "search_catalog", {"branch": "elm", "title": "The Left Hand of Darkness"}
        )
        == SEARCH_RESULT
    )


class _ToolServer(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps({"content": f"live {body['name']} {json.dumps(body['arguments'])}"})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(reply.encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tool_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ToolServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/call"
    server.shutdown()
    server.server_close()


def library(url: str, *, tools: frozenset[str] = frozenset({"patron_loans"})) -> LiveToolEndpoint:
    return LiveToolEndpoint(
        ToolEndpointConfig(name="library", kind="http", url=url, tools=tools, timeout_s=5)
    )


def test_an_unrecorded_call_goes_to_the_loops_live_tool_endpoint(tool_server: str) -> None:
    trace = failing_trace(ratchet={"policy": {"tool_endpoint": "library"}})
    task = task_of(trace)
    assert task.verifier["params"]["tool_endpoint"] == "library"
    env = ReplayEnvironment(live_tools={"library": library(tool_server)})
    assert env.tool_result(task, "patron_loans", {"patron_id": "P-9"}) == (
        'live patron_loans {"patron_id": "P-9"}'
    )
    # Recorded calls are still replayed, never sent.
    assert env.tool_result(task, "place_hold", {"book_id": "B-77", "patron_id": "P-204"}) == (
        HOLD_RESULT
    )
    with pytest.raises(ValueError, match="tool endpoint 'library'"):
        ReplayEnvironment().tool_result(task, "patron_loans", {"patron_id": "P-9"})


def test_an_unreachable_live_endpoint_is_a_tool_error(tool_server: str) -> None:
    task = task_of(failing_trace(ratchet={"policy": {"tool_endpoint": "library"}}))
    env = ReplayEnvironment(live_tools={"library": library("http://127.0.0.1:9/none")})
    assert env.tool_result(task, "patron_loans", {"patron_id": "P-9"}).startswith(
        "error: tool patron_loans gave no result: unreachable"
    )


def test_text_episodes_replay_the_same_tools() -> None:
    env = ReplayEnvironment()
    task = task_of(failing_trace())
    script = iter(
        [
            hermes("search_catalog", {"title": "The Left Hand of Darkness"}),
            "It cannot be placed: overdue loans block holds.",
        ]
    )
    episode = env.run_episode(task, lambda _: next(script), max_turns=4)
    assert [t.text for t in episode.turns if t.role == "env"] == [SEARCH_RESULT]
    assert env.verify(task, episode).passed


def test_bad_traces_are_rejected_with_a_reason() -> None:
    env = ReplayEnvironment()
    cases = {
        "no_tools": failing_trace(tools=[]),
        "no_user_message": failing_trace(messages=[{"role": "system", "content": "x"}]),
        "malformed_trace": failing_trace(tools=[{"description": "no name"}]),
        "unsupported_schema": failing_trace(schema="other/v9"),
        "bad_reference_match": failing_trace(metadata={"reference_match": "fuzzy"}),
    }
    for reason, trace in cases.items():
        rejection = env.task_from_trace(trace)
        assert isinstance(rejection, Rejection) and rejection.reason == reason, (reason, rejection)
    bad_regex = env.task_from_trace(failing_trace(reference_answer="(unclosed"))
    assert isinstance(bad_regex, Rejection) and "regular expression" in bad_regex.message


def test_a_task_of_another_environment_is_refused() -> None:
    task = task_of(failing_trace())
    foreign = TaskSpec.create(
        environment="toolcalc",
        prompt=task.prompt,
        tools=task.tools,
        verifier={"reward_id": "toolcalc/rubric-v1", "params": {}},
    )
    with pytest.raises(ValueError, match="not a replay task"):
        ReplayEnvironment().chat_start(foreign)


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates see it: OpenAI's wire form without call ids."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c.get("name") or c["function"]["name"],
                    "arguments": json.loads(
                        canonical_arguments(
                            c.get("arguments") if "arguments" in c else c["function"]["arguments"]
                        )
                    ),
                },
            }
            for c in calls
        ]
    return out

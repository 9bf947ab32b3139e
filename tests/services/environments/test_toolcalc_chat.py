"""toolcalc's chat rendering: messages, tools, stepping, the verifier and the drift."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.chat import ChatMessage
from services.chat.render import tool_call_text
from services.chat.toolcalls import parse_assistant_output
from services.environments.chat import ChatEnvironment, as_chat_environment
from services.environments.toolcalc import ToolcalcEnvironment
from services.environments.toolcalc.api import get_api
from services.environments.toolcalc.chat import extract_answer, openai_tools, user_message

ENV = ToolcalcEnvironment()


def call(name: str, **arguments: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_requests_in_words() -> None:
    assert user_message("$pear*37") == "What is the price of one pear times 37?"
    assert user_message("12+345") == "What is 12 plus 345?"
    assert (
        user_message("$kiwi+$plum") == "What is the price of one kiwi plus the price of one plum?"
    )
    assert user_message("$fig") == "What is the price of one fig?"


def test_tools_are_openai_functions_with_the_apis_schema() -> None:
    assert openai_tools(get_api("v3"))[2] == {
        "type": "function",
        "function": {
            "name": "price",
            "description": "Price of one item.",
            "parameters": {
                "type": "object",
                "properties": {
                    "item": {"type": "string"},
                    "cur": {"type": "string", "enum": ["usd", "eur"]},
                },
                "required": ["item", "cur"],
            },
        },
    }
    assert [t["function"]["name"] for t in openai_tools(get_api("v1"))] == ["add", "mul", "get"]
    assert [t["function"]["name"] for t in openai_tools(get_api("v2"))] == [
        "plus",
        "times",
        "price",
    ]


def test_a_solved_episode_step_by_step() -> None:
    assert isinstance(ENV, ChatEnvironment) and as_chat_environment(ENV) is ENV
    task = ENV.make_task("$pear*37", "v1")
    episode = ENV.chat_start(task, max_turns=4)
    assert [m.role for m in episode.messages] == ["system", "user"]
    ENV.chat_step(task, episode, "Looking it up. " + call("get", item="pear"))
    assert episode.messages[-2].tool_calls[0].id == "call_0"
    assert episode.messages[-1] == ChatMessage(
        role="tool", content="12", tool_call_id="call_0", name="get"
    )
    ENV.chat_step(task, episode, call("mul", a=12, b="37"))
    assert episode.messages[-1].content == "444" and episode.messages[-1].tool_call_id == "call_1"
    ENV.chat_step(task, episode, "The answer is 444.")
    assert episode.done and episode.end_reason == "answered"
    assert episode.final_answer == "The answer is 444."
    reward = ENV.chat_verify(task, episode)
    assert reward.passed and reward.total == 1.0


def test_the_verifier_trusts_only_the_raw_completions() -> None:
    task = ENV.make_task("$pear*37", "v1")
    episode = ENV.chat_start(task, max_turns=2)
    ENV.chat_step(task, episode, "444")
    assert ENV.chat_verify(task, episode).components == {"syntax": 0.0, "tools": 0.0, "answer": 1.0}
    forged = ENV.chat_start(task, max_turns=2)
    ENV.chat_step(task, forged, "I do not know")
    forged.messages[-1] = replace(forged.messages[-1], content="444")  # the record lies
    assert not ENV.chat_verify(task, forged).passed


def test_v2_drift_old_names_fail_and_v3_needs_the_currency() -> None:
    task = ENV.make_task("$pear*37", "v2")
    episode = ENV.chat_start(task, max_turns=3)
    ENV.chat_step(task, episode, call("get", item="pear"))
    assert episode.messages[-1].content == "error: unknown tool get"
    ENV.chat_step(task, episode, call("price", item="pear"))
    assert episode.messages[-1].content == "12"
    v3 = ENV.make_task("$pear*37", "v3")
    episode = ENV.chat_start(v3, max_turns=2)
    ENV.chat_step(v3, episode, call("price", item="pear"))
    assert episode.messages[-1].content == "error: usage price(item, cur)"
    ENV.chat_step(v3, episode, call("price", item="pear", cur="eur"))
    assert episode.messages[-1].content == "11" and episode.end_reason == "max_turns"


@pytest.mark.parametrize(
    ("arguments", "reply"),
    [
        ({"a": 1.0, "b": 2}, "3"),
        ({"a": "4", "b": "5"}, "9"),
        ({"a": True, "b": 2}, "error: usage add(a, b)"),
        ({"a": 1}, "error: usage add(a, b)"),
        ({"a": 1, "b": 2, "c": 3}, "error: usage add(a, b)"),
        ({"a": "one", "b": 2}, "error: usage add(a, b)"),
    ],
)
def test_argument_checks(arguments: dict[str, object], reply: str) -> None:
    task = ENV.make_task("12+345", "v1")
    episode = ENV.chat_start(task, max_turns=2)
    ENV.chat_step(task, episode, call("add", **arguments))
    assert episode.messages[-1].content == reply


def test_demonstrations_solve_every_version() -> None:
    for version in ("v1", "v2", "v3"):
        for task in ENV.generate_tasks(8, seed=3, api_version=version):
            pairs = ENV.chat_demonstration(task)
            episode = ENV.chat_start(task, max_turns=len(pairs))
            for _, text in pairs:
                ENV.chat_step(task, episode, text)
            assert ENV.chat_verify(task, episode).total == 1.0


def test_a_demonstration_recovers_from_a_slip_it_never_teaches() -> None:
    for version in ("v1", "v2", "v3"):
        for task in ENV.generate_tasks(8, seed=3, api_version=version):
            plain = ENV.chat_demonstration(task)
            pairs = ENV.chat_demonstration(task, recover_from_slip=True)
            assert [text for _, text in pairs] == [text for _, text in plain]
            slip, error = pairs[0][0][2], pairs[0][0][3]
            first = parse_assistant_output(plain[0][1]).tool_calls[0]
            assert slip.role == "assistant" and slip.tool_calls[0].name == first.name
            assert len(slip.tool_calls[0].arguments) == len(first.arguments) - 1
            assert error.role == "tool" and error.content.startswith("error: usage")
            episode = ENV.chat_start(task, max_turns=len(pairs) + 1)
            ENV.chat_step(task, episode, tool_call_text(first.name, slip.tool_calls[0].arguments))
            for _, text in pairs:
                ENV.chat_step(task, episode, text)
            reward = ENV.chat_verify(task, episode)
            assert reward.passed and reward.components["syntax"] < 1.0


def test_extract_answer() -> None:
    assert extract_answer("The total is 1,234.") == 1234
    assert extract_answer("12 * 37 = 444") == 444
    assert extract_answer("-5") == -5
    assert extract_answer("none") is None
    assert extract_answer(None) is None
    assert extract_answer("9" * 13) is None

"""The tiny GPT's chat template and tool-call syntax, exact values."""

from __future__ import annotations

from services.chat.protocol import ChatMessage, ToolCall
from services.environments.toolcalc import ToolcalcEnvironment
from services.inference.tiny import format_call, parse_turn, render_transcript
from tests.services.modelserver.conftest import LISTING, TOOLCALC_TOOLS


def test_a_conversation_renders_to_the_transcript_the_model_was_trained_on() -> None:
    env = ToolcalcEnvironment()
    task = env.make_task("$pear*37", "v1")
    demo = env.demonstration(task)
    messages = [ChatMessage("system", demo.system), ChatMessage("user", demo.user)]
    for turn, reply in zip(demo.turns[0::2], demo.turns[1::2], strict=False):
        if turn.tool_call is not None:
            call = turn.tool_call
            assert isinstance(call.arguments, dict)
            messages.append(
                ChatMessage(
                    "assistant", tool_calls=(ToolCall(call.call_id, call.name, call.arguments),)
                )
            )
            messages.append(ChatMessage("tool", reply.text, tool_call_id=call.call_id))
    tools = [{"type": "function", "function": spec} for spec in task.tools]
    assert render_transcript(messages, tools) == demo.transcript().rsplit("> ans", 1)[0] + "> "
    assert render_transcript(messages[:2], tools) == (
        "tools: #add(a,b) &mul(a,b) @get(item)\nuser: $pear*37\n> "
    )


def test_v3_calls_use_the_listings_separator() -> None:
    listing = "tools: #plus(a;b) &times(a;b) @price(item;cur)"
    tools = [
        {"type": "function", "function": s}
        for s in ToolcalcEnvironment().make_task("$pear*2", "v3").tools
    ]
    call = ToolCall("c", "price", {"item": "pear", "cur": "eur"})
    assert format_call(call, tools, listing) == "@price(pear;eur)"
    assert parse_turn("@price(pear;eur)", tools).tool_calls == (
        ToolCall("call_0", "price", {"item": "pear", "cur": "eur"}),
    )


def test_without_a_system_message_the_tools_are_listed() -> None:
    rendered = render_transcript([ChatMessage("user", "1+2")], TOOLCALC_TOOLS)
    assert rendered == "tools: add(a,b) get(item)\nuser: 1+2\n> "


def test_answers_and_content_render_back_as_turns() -> None:
    messages = [
        ChatMessage("system", LISTING),
        ChatMessage("user", "multi\nline"),
        ChatMessage("assistant", "12"),
        ChatMessage("assistant", "ans 13"),
    ]
    assert render_transcript(messages, TOOLCALC_TOOLS) == (
        f"{LISTING}\nuser: multi line\n> ans 12\n> ans 13\n> "
    )


def test_replies_become_calls_answers_or_content() -> None:
    assert parse_turn("ans 444", TOOLCALC_TOOLS) == ChatMessage("assistant", "444")
    assert parse_turn("#add(2, 3)", TOOLCALC_TOOLS).tool_calls == (
        ToolCall("call_0", "add", {"a": 2, "b": 3}),
    )
    assert parse_turn("@get(pear)", TOOLCALC_TOOLS).tool_calls[0].arguments == {"item": "pear"}
    # A tool the request did not offer, or the wrong number of arguments: plain content.
    assert parse_turn("&mul(2,3)", TOOLCALC_TOOLS) == ChatMessage("assistant", "&mul(2,3)")
    assert parse_turn("#add(2)", TOOLCALC_TOOLS) == ChatMessage("assistant", "#add(2)")
    assert parse_turn("   ", TOOLCALC_TOOLS) == ChatMessage("assistant", None)
    # Non-integer text for an integer parameter stays text: the tool answers with its error.
    assert parse_turn("#add(x,3)", TOOLCALC_TOOLS).tool_calls[0].arguments == {"a": "x", "b": 3}

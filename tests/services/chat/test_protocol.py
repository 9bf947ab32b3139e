import pytest

from services.chat import ChatMessage, ToolCall, validate_tools


def test_tool_call_round_trips_through_the_openai_wire_form() -> None:
    call = ToolCall(id="call_0", name="add", arguments={"a": 1, "b": 2})
    wire = call.to_openai()
    assert wire == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    assert ToolCall.from_openai(wire) == call


def test_assistant_message_with_tool_calls_round_trips() -> None:
    message = ChatMessage(
        role="assistant", tool_calls=(ToolCall(id="c1", name="price", arguments={"item": "pear"}),)
    )
    wire = message.to_openai()
    assert wire == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "price", "arguments": '{"item": "pear"}'},
            }
        ],
    }
    assert ChatMessage.from_openai(wire) == message


def test_tool_message_keeps_its_call_id_and_text_parts_are_joined() -> None:
    wire = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "7"}]}
    assert ChatMessage.from_openai(wire) == ChatMessage(role="tool", content="7", tool_call_id="c1")
    assert ChatMessage(role="tool", content="7", tool_call_id="c1").to_openai() == {
        "role": "tool",
        "content": "7",
        "tool_call_id": "c1",
    }


def test_arguments_may_arrive_as_an_object() -> None:
    wire = {"id": "x", "function": {"name": "f", "arguments": {"a": 1}}}
    assert ToolCall.from_openai(wire) == ToolCall(id="x", name="f", arguments={"a": 1})


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ("nope", "message must be an object"),
        ({"role": "robot", "content": "x"}, "message.role"),
        ({"role": "user"}, "message.content is required"),
        ({"role": "user", "content": 3}, "message.content must be"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "message.content[0]"),
        ({"role": "tool", "content": "7"}, "message.tool_call_id is required"),
        ({"role": "user", "content": "x", "tool_calls": [{}]}, "only allowed on assistant"),
        ({"role": "assistant", "tool_calls": "x"}, "message.tool_calls must be a list"),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "tool_calls[0].id"),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": ""}}]},
            "tool_calls[0].function.name",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{oops"}}],
            },
            "tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}],
            },
            "tool_calls[0].function.arguments must be a JSON object",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "code", "function": {}}]},
            "tool_calls[0].type",
        ),
        ({"role": "user", "content": "x", "name": 3}, "message.name"),
    ],
)
def test_bad_messages_name_the_field(wire: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ChatMessage.from_openai(wire)


def test_validate_tools_normalises_and_keeps_the_schema() -> None:
    tools = [{"function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    assert validate_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    assert validate_tools(
        [{"type": "function", "function": {"name": "f", "description": "d"}}]
    ) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]


@pytest.mark.parametrize(
    ("tools", "field"),
    [
        ({}, "tools must be a list"),
        (["x"], r"tools\[0\] must be an object"),
        ([{"type": "retrieval"}], r"tools\[0\]\.type"),
        ([{"type": "function"}], r"tools\[0\]\.function must be"),
        ([{"function": {"name": "has space"}}], r"tools\[0\]\.function\.name"),
        ([{"function": {"name": "a" * 65}}], r"tools\[0\]\.function\.name"),
        ([{"function": {"name": "f"}}, {"function": {"name": "f"}}], r"tools\[1\].*twice"),
        ([{"function": {"name": "f", "description": 1}}], r"function\.description"),
        ([{"function": {"name": "f", "parameters": []}}], r"function\.parameters must"),
        ([{"function": {"name": "f", "parameters": {"type": "array"}}}], r"parameters\.type"),
        (
            [{"function": {"name": "f", "parameters": {"properties": []}}}],
            r"parameters\.properties",
        ),
        ([{"function": {"name": "f", "parameters": {"required": [1]}}}], r"parameters\.required"),
    ],
)
def test_bad_tools_name_the_field(tools: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        validate_tools(tools)

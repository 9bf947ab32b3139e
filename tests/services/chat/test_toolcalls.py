from services.chat import ChatMessage, ToolCall, parse_assistant_output, tools_system_prompt
from services.chat.render import messages_with_tools_prompt


def test_tagged_block_becomes_a_call_and_the_rest_is_content() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "price", "arguments": {"item": "pear"}}\n</tool_call>'
    )
    assert parse_assistant_output(text) == ChatMessage(
        role="assistant",
        content="Let me look.",
        tool_calls=(ToolCall(id="call_0", name="price", arguments={"item": "pear"}),),
    )


def test_several_calls_get_ordered_ids_and_a_list_inside_a_tag_works() -> None:
    text = (
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
        '</tool_call><tool_call>{"name": "c", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    message = parse_assistant_output(text)
    assert message.content is None
    assert message.tool_calls == (
        ToolCall(id="call_0", name="a", arguments={}),
        ToolCall(id="call_1", name="b", arguments={"x": 1}),
        ToolCall(id="call_2", name="c", arguments={"y": 2}),
    )


def test_bare_json_object_with_string_arguments_and_parameters_key() -> None:
    text = '```json\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n```'
    assert parse_assistant_output(text) == ChatMessage(
        role="assistant",
        tool_calls=(ToolCall(id="call_0", name="add", arguments={"a": 1, "b": 2}),),
    )
    llama = '{"name": "mul", "parameters": {"a": 3, "b": 4}}'
    assert parse_assistant_output(llama).tool_calls == (
        ToolCall(id="call_0", name="mul", arguments={"a": 3, "b": 4}),
    )


def test_tool_names_keep_json_answers_as_content() -> None:
    text = 'The result is {"name": "total", "arguments": {"v": 5}}'
    message = parse_assistant_output(text, tool_names={"add"})
    assert message == ChatMessage(role="assistant", content=text)
    unfiltered = parse_assistant_output(text)
    assert unfiltered.content == "The result is"
    assert unfiltered.tool_calls == (ToolCall(id="call_0", name="total", arguments={"v": 5}),)


def test_an_unterminated_tag_still_counts_and_tagged_calls_ignore_tool_names() -> None:
    text = '<tool_call>{"name": "old_name", "arguments": {"a": 1}}'
    message = parse_assistant_output(text, tool_names={"new_name"})
    assert message.tool_calls == (ToolCall(id="call_0", name="old_name", arguments={"a": 1}),)
    assert message.content is None


def test_plain_answer_is_content_only() -> None:
    assert parse_assistant_output("  444 \n") == ChatMessage(role="assistant", content="444")
    assert parse_assistant_output("") == ChatMessage(role="assistant")


def test_garbage_never_raises() -> None:
    for text in (
        "{" * 5000,
        "[" * 5000 + "]" * 5000,
        '{"a":' * 3000,
        "<tool_call>" * 100,
        '<tool_call>{"name": 5}</tool_call>',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": ' + "9" * 5000 + "}",
        "\x00\ud800 junk {}",
    ):
        message = parse_assistant_output(text)
        assert message.role == "assistant"
        assert message.tool_calls == ()


def test_fallback_tools_prompt_is_exact() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    assert tools_system_prompt(tools) == (
        "You may call one or more functions to assist with the user query. "
        "The available functions are listed within <tools></tools>:\n<tools>\n"
        '{"description": "Add two integers.", "name": "add", "parameters": '
        '{"properties": {"a": {"type": "integer"}}, "type": "object"}}\n</tools>\n'
        "To call a function, reply with a JSON object inside <tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "The result comes back in a tool message. When you have the answer, reply with it "
        "in plain text and no tool call."
    )
    messages = messages_with_tools_prompt([{"role": "user", "content": "hi"}], tools)
    assert messages == [
        {"role": "system", "content": tools_system_prompt(tools)},
        {"role": "user", "content": "hi"},
    ]
    merged = messages_with_tools_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], tools
    )
    assert merged[0] == {"role": "system", "content": "Be brief.\n\n" + tools_system_prompt(tools)}
    assert messages_with_tools_prompt([{"role": "user", "content": "hi"}], []) == [
        {"role": "user", "content": "hi"}
    ]

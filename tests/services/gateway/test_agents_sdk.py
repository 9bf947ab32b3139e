"""The OpenAI Agents SDK (``openai-agents`` from PyPI) through the gateway, unchanged: its
default model (the Responses API) and its chat-completions model each end as one trace per
run."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.services.gateway.conftest import Stack
from tests.services.modelserver.conftest import LISTING

pytestmark = pytest.mark.slow


@function_tool
def get(item: str) -> str:
    """Price of an item."""
    return "12" if item == "pear" else "0"


async def run(stack: Stack, model_class: Any, *, stream: bool) -> None:
    """One agent run, with a client of its own (as an application would hold one)."""
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway.url}/v1", api_key=stack.key)
    agent = Agent(
        name="pricer",
        instructions=LISTING,
        tools=[get],
        model=model_class("gpt-4o", client),
        model_settings=ModelSettings(temperature=0),
    )
    if stream:
        streamed = Runner.run_streamed(agent, "$pear")
        async for _ in streamed.stream_events():
            pass
        output = streamed.final_output
    else:
        output = (await Runner.run(agent, "$pear")).final_output
    await client.close()
    assert output == "12"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_agents_sdk_default_and_chat_models_end_as_one_trace_per_run(
    stack: Stack, stream: bool
) -> None:
    set_tracing_disabled(True)
    await run(stack, OpenAIResponsesModel, stream=stream)
    await run(stack, OpenAIChatCompletionsModel, stream=stream)
    # Nothing named the sessions: the gateway grouped each run's calls by its conversation.
    keys = [session.key for session in stack.wait_placed(4)]
    assert len(keys) == 2
    for key in keys:
        closed = httpx.post(
            f"{stack.api}/v1/loops/gw-agent/sessions/{key}/close",
            headers={"Authorization": f"Bearer {stack.key}"},
            timeout=30,
        )
        assert closed.status_code == 200, closed.text
        assert closed.json()["calls"] == 2
    traces = stack.traces()
    assert len(traces) == 2
    for trace in traces:
        messages = trace.body["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert messages[2]["tool_calls"][0]["name"] == "get"
        assert messages[3]["content"] == "12" and messages[4]["content"] == "12"
        assert messages[2]["token_ids"] and messages[4]["token_ids"]
        assert [t["name"] for t in trace.body["tools"]] == ["get"]
    assert {s.status for s in stack.sessions()} == {"closed"}

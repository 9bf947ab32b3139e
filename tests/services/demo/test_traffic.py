"""The demo's production traffic: an agent with the ``openai`` client and a tool loop, against
a real ``ratchet serve``, posting its episodes to the real api (signed webhook, or
OpenTelemetry GenAI spans through the OTLP door) over a test database."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from sqlalchemy import select

from services.api.state import AppState
from services.db.models import Trace
from services.db.session import SessionFactory
from services.demo.traffic import (
    ServedModel,
    ToolcalcAgent,
    ToolcalcTools,
    TraceDestination,
    TrafficSimulator,
    episode_trace,
    toolcalc_conversation,
)
from services.serving.base import CheckpointRef
from tests.services.api.support import serve_with_loop
from tests.services.modelserver.conftest import ServerThread, demo_task


@pytest.fixture
def api(app_state: AppState) -> Iterator[tuple[str, dict[str, Any]]]:
    with serve_with_loop(app_state) as served:
        yield served


def agent_for(server: ServerThread) -> ToolcalcAgent:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    return ToolcalcAgent(client, model="ratchet")


def test_the_agent_solves_a_task_through_the_openai_api(
    serve: Callable[..., ServerThread], tool_calling_tiny: CheckpointRef
) -> None:
    episode = agent_for(serve(tool_calling_tiny)).run(demo_task(), "v1")

    assert episode.success and episode.answer == "444"
    assert [(r.name, r.arguments, r.result) for r in episode.tool_runs] == [
        ("get", {"item": "pear"}, "12"),
        ("mul", {"a": 12, "b": 37}, "444"),
    ]
    assert [m["role"] for m in episode.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episode.model_version == tool_calling_tiny.id
    trace = episode_trace(episode)
    assert trace["messages"][2]["tool_calls"][0]["arguments"] == {"item": "pear"}
    assert trace["outcome"]["success"] is True
    assert [t["name"] for t in trace["tools"]] == ["add", "mul", "get"]


def test_a_drifted_api_makes_the_same_agent_fail(
    serve: Callable[..., ServerThread], tool_calling_tiny: CheckpointRef
) -> None:
    """Under v2 the tools are renamed: the agent's old `get` call gets an error back."""
    from services.environments.toolcalc import ToolcalcEnvironment

    task = ToolcalcEnvironment().make_task("$pear*37", "v2")
    episode = agent_for(serve(tool_calling_tiny)).run(task, "v2")
    assert not episode.success


def test_the_smollm2_demo_drift_declares_the_new_argument_and_enforces_it() -> None:
    """``ratchet demo --model smollm2`` drifts to v3: the chat tool list declares ``cur`` as
    required, and a call without it gets the usage error a real API gives."""
    from services.demo import smollm2
    from services.environments.toolcalc import ToolcalcEnvironment

    task = ToolcalcEnvironment().make_task("$pear*37", smollm2.DRIFT_TO)
    _, tools = toolcalc_conversation(task, "chat")
    price = next(t["function"] for t in tools if t["function"]["name"] == "price")
    assert price["parameters"]["required"] == ["item", "cur"]
    service = ToolcalcTools(smollm2.DRIFT_TO)
    assert service.call("price", {"item": "pear"}) == "error: usage price(item, cur)"
    assert service.call("price", {"item": "pear", "cur": "usd"}) == "12"


def stored_traces(session_factory: SessionFactory, *, least: int) -> list[Trace]:
    deadline = time.monotonic() + 30
    while True:
        with session_factory() as session:
            rows = list(session.scalars(select(Trace)))
        if len(rows) >= least or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.mark.parametrize("transport", ["webhook", "otlp"])
def test_the_traffic_posts_its_episodes_as_traces(
    serve: Callable[..., ServerThread],
    checkpoints: list[CheckpointRef],
    api: tuple[str, dict[str, Any]],
    session_factory: SessionFactory,
    transport: str,
) -> None:
    server = serve(checkpoints[0])
    url, loop = api
    traffic = TrafficSimulator(
        served=ServedModel(url=server.url),
        destination=TraceDestination(
            api_url=url,
            loop=loop["name"],
            signing_secret=loop["signing_secret"],
            ingest_token=loop["ingest_token"],
            batch_size=2,
            transport=transport,  # type: ignore[arg-type]
        ),
        api_version=lambda: "v1",
        rate_per_s=20,
        workers=2,
    )
    traffic.start()
    deadline = time.monotonic() + 60
    while traffic.stats.posted < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    traffic.stop()

    assert traffic.stats.act_errors == 0 and traffic.stats.post_errors == 0
    rows = stored_traces(session_factory, least=traffic.stats.posted)
    assert len(rows) == traffic.stats.posted >= 4
    trace = rows[0]
    assert trace.model_version == checkpoints[0].id
    assert trace.success is False  # a random model answers nothing right
    assert trace.source == transport
    messages = trace.body["messages"]
    assert [m["role"] for m in messages[:2]] == ["system", "user"]
    assert messages[0]["content"].startswith("tools: ")
    _, rate_count = traffic.stats.success_rate()
    assert rate_count >= 4

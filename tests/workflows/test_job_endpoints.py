"""What a replay loop's jobs are handed of the deployment's judge and tool endpoints."""

from __future__ import annotations

import json

import pytest

from services.environments.replay.endpoints import ENV_JUDGES, ENV_TOOLS, from_job_env
from services.loop.job_documents import EndpointNotListed, endpoint_env
from services.settings import Endpoint, Settings, ToolEndpoint

SETTINGS = Settings(
    judge_endpoints={
        "grader": Endpoint(url="http://judge.internal/v1", api_key="judge-key", timeout_s=5),
        "other": Endpoint(url="http://other.internal/v1", api_key="other-key"),
    },
    tool_endpoints={
        "orders": ToolEndpoint(
            url="http://orders.internal", api_key="orders-key", tools=["order_status"]
        ),
        "desk": ToolEndpoint(kind="mcp", command=["desk-tools", "--stdio"], tools=["gate"]),
    },
)


def test_a_job_gets_only_the_endpoints_its_loop_names() -> None:
    env = endpoint_env({"judge_endpoint": "grader", "tool_endpoint": "orders"}, SETTINGS)
    judges = json.loads(env[ENV_JUDGES])
    assert judges == {
        "grader": {"url": "http://judge.internal/v1", "api_key": "judge-key", "timeout_s": 5.0}
    }
    assert "other-key" not in json.dumps(env)
    tools = json.loads(env[ENV_TOOLS])
    assert list(tools) == ["orders"]  # not the deployment's other endpoint
    assert tools["orders"]["url"] == "http://orders.internal"
    assert tools["orders"]["tools"] == ["order_status"]  # the allow-list travels
    replay = from_job_env(env)  # what the job side reads back
    orders = replay.live_tools["orders"]
    assert orders.config.api_key == "orders-key" and orders.allows("order_status")
    assert not orders.allows("cancel_order")


def test_an_mcp_endpoint_travels_as_its_command_and_allow_list() -> None:
    env = endpoint_env({"tool_endpoint": "desk"}, SETTINGS)
    assert json.loads(env[ENV_TOOLS]) == {
        "desk": {
            "kind": "mcp",
            "command": ["desk-tools", "--stdio"],
            "tools": ["gate"],
            "timeout_s": 30.0,
            "requests_per_minute": 60.0,
            "max_result_bytes": 65536,
        }
    }
    desk = from_job_env(env).live_tools["desk"].config
    assert desk.kind == "mcp" and desk.command == ("desk-tools", "--stdio")


def test_a_loop_without_endpoints_hands_its_jobs_nothing() -> None:
    assert endpoint_env({}, SETTINGS) == {}
    assert endpoint_env({"eval_fraction": 0.2}, SETTINGS) == {}


def test_an_endpoint_the_deployment_no_longer_lists_fails_the_run_naming_it() -> None:
    with pytest.raises(EndpointNotListed, match=r"'gone'.*grader, other.*RATCHET_JUDGE_ENDPOINTS"):
        endpoint_env({"judge_endpoint": "gone"}, SETTINGS)

"""What a job of the loop finds in its environment (services.loop.job_documents): the
rollout server's plain settings, and every credential apart, for the executor to hand over
without writing it down (issue 43, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

from services.loop.job_documents import job_environment, rollout_environment
from services.settings import Endpoint, ServingEndpoint, Settings, ToolEndpoint


def settings(**fields: object) -> Settings:
    return Settings.model_validate(
        {
            "judge_endpoints": {"grader": Endpoint(url="http://judge/v1", api_key="judge-key")},
            "tool_endpoints": {"orders": ToolEndpoint(url="http://orders", tools=["find_order"])},
            "serving_endpoints": {
                "rollouts": ServingEndpoint(kind="openai", url="http://vllm:8000", api_key="k"),
                "open": ServingEndpoint(kind="openai", url="http://sglang:30000"),
            },
            **fields,
        }
    )


def test_without_a_rollout_endpoint_jobs_roll_out_in_the_job(tmp_path: Path) -> None:
    assert rollout_environment(settings(), tmp_path) == rollout_environment(
        settings(rollout_endpoint=None), tmp_path
    )
    empty = rollout_environment(settings(), tmp_path)
    assert empty.plain == {} and empty.credentials == {}


def test_the_rollout_endpoint_gives_plain_settings_and_its_key_as_a_credential(
    tmp_path: Path,
) -> None:
    got = rollout_environment(
        settings(rollout_endpoint="rollouts", rollout_model="agent"), tmp_path / "run"
    )
    assert got.plain == {
        "RATCHET_ROLLOUT_URL": "http://vllm:8000",
        "RATCHET_ROLLOUT_MODEL": "agent",
        "RATCHET_ROLLOUT_SHARED_DIR": str(tmp_path / "run" / "rollouts"),
    }
    assert got.credentials == {"RATCHET_ROLLOUT_API_KEY": "k"}
    assert "credentials" not in repr(got)  # a repr (a log line, a traceback) shows none
    keyless = rollout_environment(
        settings(rollout_endpoint="open", rollout_model="agent"), tmp_path
    )
    assert keyless.credentials == {}


def test_every_endpoint_variable_is_a_credential_whatever_its_fields(tmp_path: Path) -> None:
    env = job_environment(
        {"judge_endpoint": "grader", "tool_endpoint": "orders"},
        settings(rollout_endpoint="rollouts", rollout_model="agent"),
        tmp_path,
    )
    assert set(env.credentials) == {
        "RATCHET_ROLLOUT_API_KEY",
        "RATCHET_JUDGE_ENDPOINTS",
        "RATCHET_TOOL_ENDPOINTS",  # no key in it: a credential all the same
    }
    assert json.loads(env.credentials["RATCHET_JUDGE_ENDPOINTS"])["grader"]["api_key"] == (
        "judge-key"
    )
    assert "judge-key" not in json.dumps(env.plain)

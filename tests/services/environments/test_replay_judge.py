"""The LLM judge of replay tasks, with a real ``ratchet serve`` process as the judge: the
verdict is the server's reply read by the stated rule, it is cached by task and answer, its
cost is counted, calls are spaced by the rate limit, and a judge that does not answer is an
error, never a zero."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from services.environments.base import TaskSpec
from services.environments.replay import Judge, JudgeEndpoint, ReplayEnvironment
from services.environments.replay.endpoints import (
    EndpointConfigError,
    from_job_env,
    job_env,
)
from services.environments.replay.env import prompt_text
from services.environments.replay.judge import JUDGE_SYSTEM, _judge_messages, parse_verdict
from services.training.checkpoint import save_checkpoint
from services.training.tiny.model import GPT, GPTConfig
from tests.services.environments.replay_traces import failing_trace
from tests.services.modelserver.conftest import ServeProcess

RUBRIC = "A hold for a patron with overdue loans must be refused, with the reason."


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("judge")
    config = GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=1024)
    torch.manual_seed(7)
    save_checkpoint(GPT(config), config, root / "ckpt")
    server = ServeProcess(root / "ckpt", name="grader", log=root / "serve.log")
    yield server
    server.stop()


def _judge_task() -> TaskSpec:
    policy = {
        "judge_endpoint": "grader",
        "judge_rubric": RUBRIC,
        "judge_model": "grader",
        "judge_cost_per_1k_tokens": 2.0,
    }
    task = ReplayEnvironment().task_from_trace(
        failing_trace(reference_answer=None, metadata={}, ratchet={"policy": policy})
    )
    assert isinstance(task, TaskSpec)
    return task


def _ask_directly(url: str, conversation: str, answer: str) -> str:
    body = json.dumps(
        {
            "model": "grader",
            "messages": _judge_messages(conversation, answer, RUBRIC),
            "temperature": 0.0,
            "max_tokens": 16,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return str(json.loads(response.read())["choices"][0]["message"]["content"] or "")


def test_a_ratchet_serve_judge_scores_a_replay_episode(judge_server: ServeProcess) -> None:
    judge = Judge(JudgeEndpoint(f"{judge_server.url}/v1", timeout_s=60))
    env = ReplayEnvironment(judges={"grader": judge})
    task = _judge_task()
    episode = env.chat_start(task)
    env.chat_step(task, episode, "I cannot place it: the patron has overdue loans.")
    reward = env.chat_verify(task, episode)

    conversation = prompt_text([{"role": m.role, "content": m.content} for m in episode.messages])
    reply = _ask_directly(judge_server.url, conversation, episode.final_answer or "")
    score, _ = parse_verdict(reply)
    assert reward.components == {"judge": score} and reward.passed is (score >= 0.5)
    assert judge.usage.calls == 1 and judge.usage.completion_tokens > 0
    tokens = judge.usage.prompt_tokens + judge.usage.completion_tokens
    assert judge.usage.cost_usd == pytest.approx(tokens / 1000 * 2.0)

    again = env.chat_verify(task, episode)  # the same answer to the same task: cached
    assert again == reward
    assert (judge.usage.calls, judge.usage.cache_hits) == (1, 1)
    assert env.judge_usage()["grader"]["calls"] == 1


def test_a_judge_that_does_not_answer_is_an_error() -> None:
    judge = Judge(JudgeEndpoint("http://127.0.0.1:9/v1", timeout_s=2))
    env = ReplayEnvironment(judges={"grader": judge})
    task = _judge_task()
    episode = env.chat_start(task)
    env.chat_step(task, episode, "Refused: overdue loans.")
    with pytest.raises(ValueError, match=r"judge at http://127\.0\.0\.1:9/v1 is unreachable"):
        env.chat_verify(task, episode)


def test_calls_are_spaced_by_the_rate_limit() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    judge = Judge(
        JudgeEndpoint("http://127.0.0.1:9"),
        requests_per_minute=30,
        clock=lambda: now[0],
        sleep=sleep,
    )
    for _ in range(3):
        judge._wait_turn()
    assert slept == [2.0, 2.0]


def test_an_empty_answer_fails_without_asking() -> None:
    judge = Judge(JudgeEndpoint("http://127.0.0.1:9"))
    verdict = judge.verdict(task_id="t", conversation="", answer=" ", rubric=RUBRIC, model="m")
    assert not verdict.passed and judge.usage.calls == 0


def test_jobs_get_only_the_endpoints_their_loop_names() -> None:
    settings = {
        "grader": {"url": "http://judge:8000/v1", "api_key": "k", "timeout_s": 5.0},
        "other": {"url": "http://other/v1", "api_key": None, "timeout_s": 30.0},
    }
    env_vars = job_env(judges=settings, tools={}, judge_names=["grader"])
    assert json.loads(env_vars["RATCHET_JUDGE_ENDPOINTS"]) == {"grader": settings["grader"]}
    env = from_job_env(env_vars)
    assert env.judges["grader"].endpoint == JudgeEndpoint("http://judge:8000/v1", "k", 5.0)
    assert env.live_tools == {}
    with pytest.raises(ValueError, match="not in the deployment's settings"):
        job_env(judges=settings, tools={}, tool_names=["library"])
    with pytest.raises(EndpointConfigError, match="url"):
        from_job_env({"RATCHET_TOOL_ENDPOINTS": '{"library": {}}'})
    with pytest.raises(EndpointConfigError, match="not valid JSON"):
        from_job_env({"RATCHET_JUDGE_ENDPOINTS": "{"})


def test_the_judge_is_told_the_rubric_and_the_answer() -> None:
    system, user = _judge_messages("user: hold it\n", "Refused.", RUBRIC)
    assert system == {"role": "system", "content": JUDGE_SYSTEM}
    assert RUBRIC in user["content"] and "Refused." in user["content"]

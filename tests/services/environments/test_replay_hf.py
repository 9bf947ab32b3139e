"""An hf champion's rollout in the replay environment: where it repeats the recorded calls,
every prompt it is given is the recorded conversation, token for token, under the model's
own chat template and tokenizer (a tiny random Llama built in the test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.environments.base import TaskSpec
from services.environments.replay import ReplayEnvironment
from services.training.hf.model import HFModel
from tests.services.environments.replay_traces import failing_trace
from tests.services.modelserver.hf_models import write_tiny_llama


def _wire(message: dict[str, Any]) -> dict[str, Any]:
    """A trace message in OpenAI's wire form (what the model server and templates see)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _completion(message: dict[str, Any]) -> str:
    """What a model that repeats the recorded turn writes."""
    if not message.get("tool_calls"):
        return str(message["content"])
    call = message["tool_calls"][0]
    return "<tool_call>" + json.dumps({"name": call["name"], "arguments": call["arguments"]})


def test_repeating_the_recorded_calls_gives_the_recorded_tokens(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "champion")
    model = HFModel.load(tmp_path / "champion", device="cpu")
    trace = failing_trace()
    env = ReplayEnvironment()
    task = env.task_from_trace(trace)
    assert isinstance(task, TaskSpec)
    episode = env.chat_start(task, max_turns=5)
    recorded = [_wire(m) for m in trace["messages"]]
    assistant_at = [i for i, m in enumerate(recorded) if m["role"] == "assistant"]
    for index in assistant_at:
        prompt = model.encode(model.render(episode.openai_messages(), episode.tools))
        assert prompt == model.encode(model.render(recorded[:index], episode.tools))
        env.chat_step(task, episode, _completion(trace["messages"][index]))
    full = model.encode(model.render(episode.openai_messages(), episode.tools))
    assert full == model.encode(model.render(recorded, episode.tools))
    assert not env.chat_verify(task, episode).passed  # the recorded failure, reproduced

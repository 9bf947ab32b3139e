"""Capturing the probe set in the eval job: the checkpoint's greedy answers to a few prompts.

What a probe is and how it is stored and read is :mod:`services.evaluation.probes`; this
module makes them, through the inference engine ``ratchet serve`` decodes with (torch, the
engine, the environments: a job module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.chat.protocol import ChatMessage, validate_tools
from services.environments.base import Environment, TaskSpec
from services.environments.chat import ChatEnvironment
from services.evaluation.probes import MAX_PROBES, Probe
from services.inference.engine import (
    ActiveBatch,
    Engine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

DEFAULT_PROBES = 4  # a few prompts: enough to tell two weights apart, cheap to send
PROBE_MAX_TOKENS = 16  # per probe; a token that differs shows within the first few
MIN_PROBE_TOKENS = 4  # a prompt that leaves less room than this in the context is skipped


def probe_engine(policy: object) -> Engine:
    """The inference engine over a loaded evaluation policy's weights (no second load): the
    engine ``ratchet serve`` would build from the same checkpoint."""
    from services.training.tiny.family import TinyFamilyModel
    from services.training.tiny.model import TinyModel

    checkpoint_id = getattr(policy, "checkpoint_id", None) or ""
    path = f"checkpoint:{checkpoint_id}"
    if isinstance(policy, TinyFamilyModel):
        policy = TinyModel(
            policy.net,
            tokenizer=policy.tokenizer,
            device=policy.device,
            checkpoint_id=checkpoint_id,
        )
    if isinstance(policy, TinyModel):
        from services.inference.tiny import TinyEngine

        return TinyEngine(policy, path)
    chat = getattr(policy, "chat", None)  # the hf family's HFModel
    if chat is not None and hasattr(chat, "model") and hasattr(chat, "tokenizer"):
        from services.inference.hf import HFEngine

        return HFEngine(chat.model, chat.tokenizer, path=path, version=checkpoint_id)
    raise ValueError(f"no inference engine for a {type(policy).__name__} policy")


def probe_request(env: Environment, task: TaskSpec) -> tuple[list[dict[str, Any]], list[Any]]:
    """A task's first turn as an agent's OpenAI request: the environment's chat start when it
    has one, else the task's prompt as one user message with the task's tools."""
    if isinstance(env, ChatEnvironment):
        episode = env.chat_start(task, max_turns=1)
        return episode.openai_messages(), list(episode.tools)
    return [{"role": "user", "content": task.prompt}], list(task.tools)


def capture_probes(
    engine: Engine,
    env: Environment,
    tasks: Sequence[TaskSpec],
    *,
    count: int = DEFAULT_PROBES,
    max_tokens: int = PROBE_MAX_TOKENS,
) -> list[Probe]:
    """Greedy answers of ``engine`` to the requests of the first ``count`` tasks whose prompt
    leaves room for :data:`MIN_PROBE_TOKENS` in the model's context (one batch; each probe
    decodes up to ``max_tokens``, less when the context is shorter); fewer when fewer fit."""
    chosen: list[tuple[TaskSpec, list[dict[str, Any]], list[Any], list[int], int]] = []
    for task in tasks:
        if len(chosen) >= min(count, MAX_PROBES):
            break
        messages, tools = probe_request(env, task)
        parsed = [ChatMessage.from_openai(m, where="probe message") for m in messages]
        prompt = engine.render(parsed, validate_tools(tools) if tools else [])
        room = min(max_tokens, engine.context_length() - len(prompt) - 1)
        if room >= MIN_PROBE_TOKENS:
            chosen.append((task, messages, tools, prompt, room))
    batch: ActiveBatch[int] = ActiveBatch(engine)
    batch.join(
        [
            (
                GenerationRequest(
                    list(prompt), SamplingParams(room, temperature=0.0, top_logprobs=2)
                ),
                i,
            )
            for i, (_, _, _, prompt, room) in enumerate(chosen)
        ]
    )
    results: dict[int, GenerationResult] = {}
    while len(batch):
        results.update(batch.step())
    probes = []
    for i, (task, messages, tools, prompt, room) in enumerate(chosen):
        result = results[i]
        stopped = len(result.sampled_ids) > len(result.token_ids)
        margins, runners_up = _runners_up(result)
        probes.append(
            Probe(
                task_id=task.task_id,
                messages=messages,
                tools=tools,
                max_tokens=room,
                prompt_token_ids=prompt,
                token_ids=list(result.token_ids),
                stop_id=result.sampled_ids[-1] if stopped else None,
                logprobs=[float(x) for x in result.logprobs],
                text=engine.decode_text(result.token_ids),
                margins=margins,
                runners_up=runners_up,
            )
        )
    return probes


def _runners_up(result: GenerationResult) -> tuple[list[float] | None, list[int] | None]:
    """Per sampled id, the greedy choice's lead over the runner-up (nats) and the
    runner-up's id (the likeliest other id: on an exact tie, top-k may list either first);
    None when the engine reported fewer than two candidates somewhere."""
    tops = result.top_logprobs
    if len(tops) != len(result.sampled_ids) or any(len(top) < 2 for top in tops):
        return None, None
    margins: list[float] = []
    runners_up: list[int] = []
    for sampled, logprob, top in zip(result.sampled_ids, result.logprobs, tops, strict=True):
        runner_id, runner_logprob = next((i, lp) for i, lp in top if i != sampled)
        margins.append(max(0.0, float(logprob) - float(runner_logprob)))
        runners_up.append(int(runner_id))
    return margins, runners_up

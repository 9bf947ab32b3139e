"""Batched multi-turn chat rollouts for hf models, and the token view training needs.

:func:`run_chat_episodes` steps many chat episodes in lockstep: each round renders every
unfinished episode's conversation with the chat template, generates all next turns in one
batched call, and lets the environment apply each completion (answering tool calls with
``tool`` messages). For every assistant turn it records the exact prompt ids the model saw
and the ids it generated (end-of-turn token included when sampled): training scores those
very tokens, so rollout and loss never disagree about tokenization.

:func:`pack_turns` joins an episode's turns into as few sequences as the template allows:
when turn ``k+1``'s prompt starts with turn ``k``'s prompt and completion (the usual case
for ChatML templates once the completion is the canonical call text), the two are one
sequence with both completions as targets; otherwise a turn is its own sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.environments.base import TaskSpec
from services.environments.chat import ChatEnvironment, ChatEpisode
from services.training.hf.model import HFModel
from services.training.rng import derive_seed

TokenTurn = tuple[list[int], list[int]]  # (prompt ids, completion ids)


@dataclass
class ChatRollout:
    """One episode with the token record of its assistant turns."""

    episode: ChatEpisode
    turns: list[TokenTurn] = field(default_factory=list)


@dataclass(frozen=True)
class ChatRolloutStats:
    generated_tokens: int
    prompt_tokens: int
    rounds: int


def run_chat_episodes(
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    policy: HFModel,
    *,
    seed: int,
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    max_prompt_tokens: int = 2048,
) -> tuple[list[ChatRollout], ChatRolloutStats]:
    """Roll out one chat episode per task (tasks may repeat, e.g. a GRPO group)."""
    rollouts = [ChatRollout(env.chat_start(task, max_turns=max_turns)) for task in tasks]
    generated = prompt_tokens = rounds = 0
    while True:
        active = [i for i, r in enumerate(rollouts) if not r.episode.done]
        if not active:
            break
        prompts = []
        for i in list(active):
            episode = rollouts[i].episode
            text = policy.render(episode.openai_messages(), episode.tools)
            if len(policy.encode(text)) + max_new_tokens > max_prompt_tokens:
                episode.done, episode.end_reason = True, "context_limit"
                active.remove(i)
                continue
            prompts.append(text)
        if not active:
            break
        outputs = policy.generate(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=derive_seed(seed, rounds),
        )
        for i, completion in zip(active, outputs, strict=True):
            rollout = rollouts[i]
            env.chat_step(
                tasks[i], rollout.episode, completion.text, truncated=completion.truncated
            )
            rollout.turns.append((completion.prompt_ids, completion.completion_ids))
            generated += len(completion.completion_ids)
            prompt_tokens += len(completion.prompt_ids)
        rounds += 1
    return rollouts, ChatRolloutStats(generated, prompt_tokens, rounds)


def pack_turns(turns: Sequence[TokenTurn]) -> list[tuple[list[int], list[bool]]]:
    """An episode's turns as (ids, target mask) sequences, merged where prefixes agree."""
    sequences: list[tuple[list[int], list[bool]]] = []
    for prompt, completion in turns:
        if sequences:
            ids, mask = sequences[-1]
            if len(prompt) >= len(ids) and prompt[: len(ids)] == ids:
                extra = prompt[len(ids) :]
                ids.extend(extra + completion)
                mask.extend([False] * len(extra) + [True] * len(completion))
                continue
        sequences.append(
            (list(prompt) + list(completion), [False] * len(prompt) + [True] * len(completion))
        )
    return sequences

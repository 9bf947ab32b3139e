"""Batched multi-turn chat rollouts for hf models, and the token view training needs.

:func:`run_chat_episodes` steps many chat episodes in lockstep: each round renders every
unfinished episode's conversation with the chat template, generates all next turns in one
batched call, and lets the environment apply each completion (answering tool calls with
``tool`` messages). For every assistant turn it records the exact prompt ids the model saw
and the ids it generated (end-of-turn token included when sampled): training scores those
very tokens, so rollout and loss never disagree about tokenization. Episode ``i`` at round
``r`` samples with seed ``derive_seed(seeds[i], r)``, as the tiny family's episodes do.

:func:`demonstration_sequences` renders the environment's solved conversations the same
way, so SFT trains on exactly the prompts a rollout would see.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.environments.base import TaskSpec
from services.environments.chat import ChatEnvironment, ChatEpisode
from services.training.family import TokenSequence, TokenTurn, pack_turns
from services.training.rng import derive_seed


@dataclass(frozen=True)
class Completion:
    """One generated turn: the prompt's token ids, the generated ids and their text."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    truncated: bool


class ChatGenerator(Protocol):
    """What chat rollouts need from a model (:class:`services.training.hf.model.HFModel`)."""

    @property
    def end_of_turn_id(self) -> int: ...

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | Sequence[int] = 0,
    ) -> list[Completion]: ...


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
    policy: ChatGenerator,
    *,
    seeds: Sequence[int],
    max_turns: int,
    max_new_tokens: int,
    temperature: float,
    max_prompt_tokens: int = 2048,
) -> tuple[list[ChatRollout], ChatRolloutStats]:
    """Roll out one chat episode per task (tasks may repeat, e.g. a GRPO group)."""
    if len(seeds) != len(tasks):
        raise ValueError("need one seed per task")
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
            seed=[derive_seed(seeds[i], rounds) for i in active],
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


def demonstration_sequences(
    env: ChatEnvironment,
    tasks: Sequence[TaskSpec],
    policy: ChatGenerator,
    *,
    recovery_fraction: float = 0.0,
    seed: int = 0,
) -> list[TokenSequence]:
    """Token sequences of the solved conversations, assistant turns (and end-of-turn) targets.

    A seeded share ``recovery_fraction`` of them recover from a slip first (a call missing
    an argument, answered by the tool's usage error): under an API change, a champion that
    has seen errors followed varies its calls, where one that never saw an error repeats
    its call (measured in docs/models.md, run 4).
    """
    if not 0.0 <= recovery_fraction <= 1.0:
        raise ValueError("recovery_fraction must be in [0, 1]")
    end_of_turn = policy.end_of_turn_id
    sequences: list[TokenSequence] = []
    rng = random.Random(f"hf/demonstrations/{seed}")
    for task in tasks:
        slip = rng.random() < recovery_fraction
        pairs = env.chat_demonstration(task, recover_from_slip=slip)
        tools = env.chat_start(task, max_turns=1).tools
        turns = []
        for messages, text in pairs:
            prompt = policy.encode(policy.render([m.to_openai() for m in messages], tools))
            turns.append((prompt, [*policy.encode(text), end_of_turn]))
        sequences.extend(pack_turns(turns))
    return sequences

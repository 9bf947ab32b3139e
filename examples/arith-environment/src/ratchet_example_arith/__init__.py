"""Arithmetic questions as a Ratchet environment, registered through an entry point.

The task is the user's question; the verifier parses the two operands and the operator out
of the question and recomputes the answer, so a trace whose agent claimed success with a
wrong number still becomes a task with the right reference answer.

Rubric: ``format`` (0.2) the final turn is ``ans <integer>``; ``answer`` (0.8) it is right.
A task passes only on the right answer.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.environments.base import (
    TRACE_SCHEMA,
    Act,
    Episode,
    Rejection,
    Reward,
    TaskSpec,
    Turn,
    run_episode_with,
)

NAME = "arith"
REWARD_ID = "arith/exact-v1"
WEIGHTS = {"format": 0.2, "answer": 0.8}
INSTRUCTIONS = "Answer the arithmetic question. Reply with: ans <integer>"

_OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_QUESTION = re.compile(r"(-?\d{1,6})\s*([+*-])\s*(-?\d{1,6})")
_ANSWER = re.compile(r"^ans\s+(-?\d{1,13})$")


def solve(question: str) -> int | None:
    """The answer to the first ``a op b`` in the question, or None when there is none."""
    match = _QUESTION.search(question)
    if match is None:
        return None
    left, symbol, right = match.groups()
    return _OPERATORS[symbol](int(left), int(right))


class ArithEnvironment:
    """``what is a op b?`` -> ``ans <integer>``; one turn (or a few retries) per episode."""

    name = NAME

    def make_task(self, question: str, *, metadata: Mapping[str, Any] | None = None) -> TaskSpec:
        answer = solve(question)
        if answer is None:
            raise ValueError(f"no arithmetic in {question!r}")
        return TaskSpec.create(
            environment=NAME,
            prompt=f"{INSTRUCTIONS}\nuser: {question}\n",
            tools=[],
            verifier={"reward_id": REWARD_ID, "params": {"question": question}},
            reference_answer=str(answer),
            metadata=dict(metadata or {}),
        )

    def generate_tasks(self, n: int, *, seed: int, api_version: str = "v1") -> list[TaskSpec]:
        rng = random.Random(f"arith/{seed}")
        tasks: dict[str, TaskSpec] = {}
        while len(tasks) < n:
            symbol = rng.choice(sorted(_OPERATORS))
            question = f"what is {rng.randint(0, 99)} {symbol} {rng.randint(0, 99)}?"
            task = self.make_task(question)
            tasks.setdefault(task.task_id, task)
        return list(tasks.values())

    def start(self, task: TaskSpec, *, max_turns: int = 2) -> Episode:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        return Episode(
            task_id=task.task_id,
            prompt=task.prompt,
            system=INSTRUCTIONS,
            user=str(task.verifier["params"]["question"]),
            max_turns=max_turns,
        )

    def step(self, task: TaskSpec, episode: Episode, action: str) -> None:
        if episode.done:
            raise ValueError("episode is already done")
        raw = action.replace("\n", " ")
        answer = _ANSWER.match(raw.strip())
        if answer is not None:
            episode.turns.append(Turn("agent", raw, answer=answer.group(1)))
            episode.done, episode.end_reason = True, "answered"
            return
        episode.turns.append(Turn("agent", raw))
        episode.turns.append(Turn("env", "error: reply with ans <integer>", error="not_a_turn"))
        if len(episode.agent_turns) >= episode.max_turns:
            episode.done, episode.end_reason = True, "max_turns"

    def run_episode(self, task: TaskSpec, act: Act, *, max_turns: int = 2) -> Episode:
        return run_episode_with(self, task, act, max_turns=max_turns)

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        expected = solve(str(task.verifier.get("params", {}).get("question", "")))
        final = episode.final_answer
        components = {
            "format": 1.0 if final is not None else 0.0,
            "answer": 1.0 if final is not None and int(final) == expected else 0.0,
        }
        total = sum(WEIGHTS[key] * value for key, value in components.items())
        return Reward(
            components=components, total=round(total, 6), passed=components["answer"] == 1
        )

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        if trace.get("schema", TRACE_SCHEMA) != TRACE_SCHEMA:
            return Rejection("unsupported_schema", f"trace schema {trace.get('schema')!r}")
        messages = trace.get("messages")
        if not isinstance(messages, list):
            return Rejection("malformed_trace", "trace has no messages list")
        question = next(
            (
                m.get("content")
                for m in messages
                if isinstance(m, Mapping) and m.get("role") == "user"
            ),
            None,
        )
        if not isinstance(question, str) or not question.strip():
            return Rejection("no_user_message", "trace has no user message with text")
        if solve(question) is None:
            return Rejection("no_arithmetic", "the question holds no `a op b` to check")
        return self.make_task(question.strip(), metadata={"external_id": trace.get("external_id")})

    def demonstrations(
        self, tasks: Sequence[TaskSpec], *, seed: int, augment_fraction: float = 0.0
    ) -> list[Episode]:
        episodes = []
        for task in tasks:
            episode = self.start(task, max_turns=1)
            self.step(task, episode, f"ans {task.reference_answer}")
            episodes.append(episode)
        return episodes

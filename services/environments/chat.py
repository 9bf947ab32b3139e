"""The chat side of an environment: a task as OpenAI messages + tools, stepped by completions.

This is how ``hf`` models meet an environment (the agent protocol of DESIGN §5): the task
is a conversation (``system``, ``user``) plus JSON-schema function tools; each agent turn
is a raw completion, parsed into an assistant message (tool calls or a final answer); each
tool call is answered by a ``tool`` message; the episode ends on an answer without tool
calls or after ``max_turns`` assistant turns. The raw completions are kept so the verifier
re-parses what the model wrote and trusts nothing else the episode holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from services.chat.protocol import ChatMessage
from services.environments.base import Reward, TaskSpec


@dataclass
class ChatEpisode:
    """A chat rollout in progress or finished."""

    task_id: str
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    max_turns: int
    completions: list[str] = field(default_factory=list)  # raw text of each assistant turn
    truncated: list[bool] = field(default_factory=list)
    done: bool = False
    end_reason: str | None = None

    @property
    def assistant_turns(self) -> int:
        return len(self.completions)

    @property
    def final_answer(self) -> str | None:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant" and not last.tool_calls:
            return last.content
        return None

    def openai_messages(self) -> list[dict[str, Any]]:
        return [m.to_openai() for m in self.messages]


@runtime_checkable
class ChatEnvironment(Protocol):
    """What an environment adds so chat models (the ``hf`` family) can be trained on it."""

    name: str

    def chat_start(self, task: TaskSpec, *, max_turns: int) -> ChatEpisode:
        """Open a chat episode: the task's messages and tools, no assistant turn yet."""
        ...

    def chat_step(
        self, task: TaskSpec, episode: ChatEpisode, completion: str, *, truncated: bool = False
    ) -> None:
        """Apply one raw completion: record the assistant message and the tool replies."""
        ...

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        """Score a finished chat episode from its raw completions (recomputed, not trusted)."""
        ...

    def chat_demonstration(
        self, task: TaskSpec, *, recover_from_slip: bool = False
    ) -> list[tuple[list[ChatMessage], str]]:
        """The solved conversation as (messages before the turn, assistant text) pairs;
        ``recover_from_slip`` opens with a faulty call and its tool error as context."""
        ...


def as_chat_environment(env: object) -> ChatEnvironment:
    """``env`` as a chat environment, or a ValueError saying it has no chat rendering."""
    if not isinstance(env, ChatEnvironment):
        name = getattr(env, "name", type(env).__name__)
        raise ValueError(
            f"environment {name!r} has no chat rendering (chat_start/chat_step/chat_verify); "
            "hf models need one"
        )
    return env

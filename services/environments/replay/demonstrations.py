"""Demonstrations of replay tasks: a successful trace's conversation, as SFT trains on it.

A replay task curated from a failure has nothing to imitate (its trace went wrong); one that
bootstrap builds from a *successful* trace (services.curation.bootstrap, ``ratchet loop
bootstrap``) keeps the conversation after its prompt under ``metadata.replay.demonstration``:
the agent's turns (text and tool calls) and the results its tools gave, in the trace's own
``ratchet.trace/v1`` shape.

- :func:`demonstration_messages` reads that part of a trace, or says why it cannot teach: a
  later user turn (a replay episode starts from the first request and only the agent speaks
  after it), a call of a tool the trace does not list, a call nobody answered, no final
  answer.
- :func:`chat_demonstration` replays the agent's turns through the environment's own chat
  episode (``chat_start``, ``chat_step``), so the prompts SFT trains on are exactly those a
  rollout of the task sees: the template's tool listing, the call ids, the tool messages the
  sandbox writes (from the task's own recorded calls, which are this trace's). Each turn's
  target is its text as the hf family writes it: the content, then every call as a
  ``<tool_call>`` block (services.chat.render.tool_call_text).
- :func:`replay_mismatch` says where the replayed conversation departs from the recorded one
  (a result the sandbox gives differently), so bootstrap leaves such a trace out rather than
  teach a conversation that never happened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from services.chat.protocol import ChatMessage
from services.chat.render import tool_call_text
from services.environments.base import Rejection, TaskSpec
from services.environments.chat import ChatEpisode


class ChatReplay(Protocol):
    """What a demonstration is replayed through (the replay environment)."""

    def chat_start(self, task: TaskSpec, *, max_turns: int = ...) -> ChatEpisode: ...

    def chat_step(
        self, task: TaskSpec, episode: ChatEpisode, completion: str, *, truncated: bool = False
    ) -> None: ...


def demonstration_messages(trace: Mapping[str, Any]) -> list[dict[str, Any]] | Rejection:
    """The agent's turns and their tool results after the trace's prompt (the messages from
    its first assistant turn on), normalized; or why they cannot be a demonstration."""
    tools = {t.get("name") for t in trace.get("tools") or [] if isinstance(t, Mapping)}
    messages = [m for m in trace.get("messages") or [] if isinstance(m, Mapping)]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        return Rejection("no_final_answer", "the trace has no assistant turn")
    turns: list[dict[str, Any]] = []
    answered = {m.get("tool_call_id") for m in messages[first:] if m.get("role") == "tool"}
    for message in messages[first:]:
        role = message.get("role")
        if role == "assistant":
            calls = [_call(call) for call in message.get("tool_calls") or []]
            problem = _call_problem(calls, tools, answered)
            if problem is not None:
                return problem
            turns.append(
                {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
            )
        elif role == "tool":
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": message.get("tool_call_id"),
                    "name": message.get("name"),
                    "content": _text(message.get("content")),
                }
            )
        else:
            return Rejection(
                "later_user_turn",
                f"a {role} message follows the agent's first turn; a replay episode starts "
                "from the first request and only the agent speaks after it",
            )
    last = turns[-1]
    if last["role"] != "assistant" or last["tool_calls"] or not _text(last["content"]).strip():
        return Rejection("no_final_answer", "the conversation does not end in an answer")
    return turns


def assistant_text(turn: Mapping[str, Any]) -> str:
    """One agent turn as the hf family writes it: its text, then a block per call."""
    parts = [_text(turn.get("content")).strip()]
    parts += [tool_call_text(call["name"], call["arguments"]) for call in turn["tool_calls"]]
    return "\n".join(part for part in parts if part)


def chat_demonstration(env: ChatReplay, task: TaskSpec) -> list[tuple[list[ChatMessage], str]]:
    """The task's demonstration as (messages so far, agent text) pairs, one per agent turn,
    replayed through ``env`` (see the module); ValueError for a task that has none."""
    return _replay(env, task)[0]


def replay_mismatch(env: ChatReplay, task: TaskSpec) -> str | None:
    """Where the replayed conversation departs from the recorded one, or None: the tool
    results the sandbox gives must be the trace's, call for call, and the episode must end
    on the agent's answer."""
    try:
        _, episode = _replay(env, task)
    except ValueError as exc:
        return str(exc)
    if episode.end_reason != "answered":
        return f"the replayed episode ended by {episode.end_reason}, not on the answer"
    replayed = [m.content or "" for m in episode.messages if m.role == "tool"]
    expected = _results_in_call_order(_turns(task))
    for index, (got, want) in enumerate(zip(replayed, expected, strict=False)):
        if got != want:
            return f"call {index + 1} replays as {got[:80]!r}, recorded {want[:80]!r}"
    if len(replayed) != len(expected):
        return f"{len(replayed)} tool results replayed, {len(expected)} recorded"
    return None


def _replay(
    env: ChatReplay, task: TaskSpec
) -> tuple[list[tuple[list[ChatMessage], str]], ChatEpisode]:
    """The agent's turns stepped through a fresh chat episode of ``task``: the pairs, and
    the episode as it ended."""
    agent = [turn for turn in _turns(task) if turn["role"] == "assistant"]
    episode = env.chat_start(task, max_turns=len(agent))
    pairs: list[tuple[list[ChatMessage], str]] = []
    for turn in agent:
        text = assistant_text(turn)
        pairs.append((list(episode.messages), text))
        env.chat_step(task, episode, text)
    return pairs, episode


def _turns(task: TaskSpec) -> list[dict[str, Any]]:
    replay = task.metadata.get("replay")
    turns = replay.get("demonstration") if isinstance(replay, Mapping) else None
    if not isinstance(turns, list) or not turns:
        raise ValueError(
            f"replay task {task.task_id[:12]} has no demonstration: tasks curated from "
            "failures are trained with grpo or rft; `ratchet loop bootstrap` builds "
            "demonstrations from successful traces"
        )
    return turns


def _results_in_call_order(turns: Sequence[Mapping[str, Any]]) -> list[str]:
    results = {t.get("tool_call_id"): t.get("content") for t in turns if t["role"] == "tool"}
    return [
        str(results.get(call["id"]))
        for turn in turns
        if turn["role"] == "assistant"
        for call in turn["tool_calls"]
    ]


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        return {"id": None, "name": None, "arguments": {}}
    return {"id": call.get("id"), "name": call.get("name"), "arguments": call.get("arguments", {})}


def _call_problem(
    calls: Sequence[Mapping[str, Any]], tools: set[Any], answered: set[Any]
) -> Rejection | None:
    for call in calls:
        if call["name"] not in tools:
            return Rejection(
                "unknown_tool_call",
                f"the agent called {call['name']!r}, which the trace does not list",
            )
        if call["id"] is None or call["id"] not in answered:
            return Rejection(
                "unanswered_tool_call", f"the agent's call of {call['name']} has no recorded result"
            )
    return None


def _text(content: Any) -> str:
    """Message content as text (a list of parts is joined, as the chat template would)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) if isinstance(part, Mapping) else str(part)
            for part in content
        )
    return ""

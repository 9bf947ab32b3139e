"""``replay``: the built-in environment for any OpenAI-tools agent, made from its own traces.

A ``ratchet.trace/v1`` trace becomes a task whose

- **prompt** is the conversation up to the first assistant turn (system and user messages),
- **tools** are the trace's own tools (a task keeps the schema its trace had, so tools that
  drifted between traces give tasks with different tool lists),
- **sandbox** replays recorded results: a call whose tool name, tool schema hash and
  canonical arguments (see :mod:`.records`) were recorded, in this trace or in another trace
  of the loop (the tool-response store curation keeps and ships with each dataset), gets
  that result, error texts included; any other call gets ``error: no recorded result for
  tool X with these arguments``, unless the loop names a live tool endpoint of the
  deployment's ``settings.tool_endpoints`` (HTTP or MCP, :mod:`.tool_endpoints`) whose
  allow-list holds X, which then answers it; what it answers is kept for the next rollout
  and what nobody could answer is counted per task (:mod:`.sandbox`). A call of a tool the
  task does not list gets ``error: unknown tool X``; a call missing a required argument of
  the task's schema gets the usage error the real tool would give;
- **reward** is one of two kinds, chosen at curation in order of trust (:mod:`.rewards`):
  a reference answer checked by a stated rule (:mod:`.matching`; ``facts`` by default,
  :mod:`.facts`), or an LLM judge's verdict under the loop's rubric (:mod:`.judge`), marked
  ``verifier_kind: judge`` on the task; scored by :mod:`.scoring`.

Episodes are multi-turn: each assistant turn is parsed for tool calls (Hermes
``<tool_call>`` blocks or bare JSON naming a listed tool, :mod:`services.chat.toolcalls`),
every call is answered by a ``tool`` message, and the episode ends on an answer without
calls or after ``max_turns`` assistant turns. An agent that repeats the recorded calls gets
the recorded results back, so its conversation is the recorded one, token for token.

Curation passes what the trace body itself cannot hold (the trace's feedback, the answer of
a successful trace of the same conversation, the loop's reward settings) under the trace's
``ratchet`` key, which the ingest schema refuses from clients, so no agent can forge it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.chat.protocol import ChatMessage
from services.chat.toolcalls import parse_assistant_output
from services.environments.base import (
    TRACE_SCHEMA,
    Act,
    Episode,
    Rejection,
    Reward,
    TaskSpec,
    ToolCall,
    Turn,
    run_episode_with,
    user_request,
)
from services.environments.chat import ChatEpisode
from services.environments.replay import scoring
from services.environments.replay.demonstrations import (
    chat_demonstration as replay_demonstration,
)
from services.environments.replay.judge import Judge
from services.environments.replay.records import (
    RecordedCall,
    StoreFileError,
    as_table,
    canonical_arguments,
    flat_tool,
    read_store_file,
    recorded_calls,
    schema_hash,
)
from services.environments.replay.rewards import choose_reward, json_object
from services.environments.replay.sandbox import SandboxLedger, arguments_object, usage_error
from services.environments.replay.tool_endpoints import LiveToolEndpoint, ToolAnswer, no_record

ENVIRONMENT_NAME = "replay"
REWARD_ID = "replay/v1"
DEFAULT_MAX_TURNS = 8
_STORES_MAX = 4
_OWN_MAX = 4096


class ReplayEnvironment:
    """Tasks from any OpenAI-tools agent's traces, with a sandbox of recorded tool results.

    ``judges`` and ``live_tools`` map the endpoint names a loop may use to resolved
    endpoints; the registry builds the environment with neither, and a task that needs one
    then fails with a message naming it.
    """

    name = ENVIRONMENT_NAME

    def __init__(
        self,
        *,
        judges: Mapping[str, Judge] | None = None,
        live_tools: Mapping[str, LiveToolEndpoint] | None = None,
    ) -> None:
        self.judges = dict(judges or {})
        self.live_tools = dict(live_tools or {})
        self._stores: dict[str, dict[tuple[str, str, str], str]] = {}
        self._own: dict[str, dict[tuple[str, str, str], str]] = {}
        self._lock = threading.Lock()
        self._ledger = SandboxLedger()

    def __getstate__(self) -> dict[str, Any]:
        """Curation ships the adapter to worker processes: endpoints and caches stay home."""
        return {"environment": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.judges, self.live_tools = {}, {}
        self._stores, self._own = {}, {}
        self._lock = threading.Lock()
        self._ledger = SandboxLedger()

    # -- tasks --------------------------------------------------------------------------

    def generate_tasks(self, n: int, *, seed: int, api_version: str = "") -> list[TaskSpec]:
        raise NotImplementedError("replay tasks come from traces; it generates none")

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        """The task behind an OpenAI-tools trace, with the most trusted reward it allows."""
        shape = _trace_shape(trace)
        if isinstance(shape, Rejection):
            return shape
        tools, messages = shape
        request = user_request(messages)
        if isinstance(request, Rejection):
            return request
        first_assistant = next(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages)
        )
        prefix = [_prefix_message(m) for m in messages[:first_assistant]]
        context = json_object(trace.get("ratchet"))
        settings = json_object(context.get("policy"))
        reward = choose_reward(trace, messages, context, settings)
        if isinstance(reward, Rejection):
            return reward
        spec, reference = reward
        metadata = {
            "environment": self.name,
            "verifier_kind": spec["kind"],
            "reward_source": spec.get("source", "judge"),
            "replay": {
                "messages": prefix,
                "recorded": [call.to_dict() for call in recorded_calls(trace)],
            },
            "source": {
                "external_id": trace.get("external_id"),
                "model_version": trace.get("model_version"),
            },
        }
        tool_endpoint = settings.get("tool_endpoint")
        return TaskSpec.create(
            environment=self.name,
            prompt=prompt_text(prefix),
            tools=tools,
            verifier={
                "reward_id": REWARD_ID,
                "params": {"reward": spec, "tool_endpoint": tool_endpoint},
            },
            reference_answer=reference,
            metadata=metadata,
        )

    # -- text episodes (the tiny family's transcripts) -----------------------------------

    def start(self, task: TaskSpec, *, max_turns: int = DEFAULT_MAX_TURNS) -> Episode:
        prefix = self._prefix(task, max_turns)
        system = "\n".join(str(m.get("content") or "") for m in prefix if m["role"] == "system")
        user = next(str(m.get("content")) for m in prefix if m["role"] == "user")
        return Episode(
            task_id=task.task_id,
            prompt=task.prompt,
            system=system or None,
            user=user,
            max_turns=max_turns,
        )

    def step(self, task: TaskSpec, episode: Episode, action: str) -> None:
        if episode.done:
            raise ValueError("episode is already done")
        message = parse_assistant_output(action, self._tool_names(task))
        text = action.replace("\n", " ")
        if not message.tool_calls:
            episode.turns.append(Turn("agent", text, answer=(message.content or "").strip()))
            episode.done, episode.end_reason = True, "answered"
            return
        for index, call in enumerate(message.tool_calls):
            call_id = f"call_{len(episode.agent_turns) + 1}_{index}"
            episode.turns.append(
                Turn("agent", text, tool_call=ToolCall(call_id, call.name, dict(call.arguments)))
            )
            result = self._episode_tool_result(task, episode, call.name, call.arguments)
            episode.turns.append(Turn("env", result.replace("\n", " ")))
        if len(episode.agent_turns) >= episode.max_turns:
            episode.done, episode.end_reason = True, "max_turns"

    def run_episode(
        self, task: TaskSpec, act: Act, *, max_turns: int = DEFAULT_MAX_TURNS
    ) -> Episode:
        return run_episode_with(self, task, act, max_turns=max_turns)

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        self._ledger.episode_verified(task.task_id, episode)
        return self._score(task, episode.final_answer, conversation=episode.full_text())

    def demonstrations(
        self, tasks: Sequence[TaskSpec], *, seed: int, augment_fraction: float = 0.0
    ) -> list[Episode]:
        raise NotImplementedError(
            "replay tasks have no demonstrations (only a reference answer or a judge): "
            "train them with grpo or rft"
        )

    # -- chat episodes (the hf family) ----------------------------------------------------

    def chat_start(self, task: TaskSpec, *, max_turns: int = DEFAULT_MAX_TURNS) -> ChatEpisode:
        prefix = self._prefix(task, max_turns)
        return ChatEpisode(
            task_id=task.task_id,
            messages=[
                ChatMessage(role=m["role"], content=m.get("content"), name=m.get("name"))
                for m in prefix
            ],
            tools=openai_tools(task.tools),
            max_turns=max_turns,
        )

    def chat_step(
        self, task: TaskSpec, episode: ChatEpisode, completion: str, *, truncated: bool = False
    ) -> None:
        if episode.done:
            raise ValueError("episode is already done")
        message = parse_assistant_output(completion, self._tool_names(task))
        first = sum(len(m.tool_calls) for m in episode.messages)
        calls = tuple(
            replace(call, id=f"call_{first + i}") for i, call in enumerate(message.tool_calls)
        )
        episode.completions.append(completion)
        episode.truncated.append(truncated)
        episode.messages.append(replace(message, tool_calls=calls))
        if not calls:
            episode.done, episode.end_reason = True, "answered"
            return
        for call in calls:
            result = self._episode_tool_result(task, episode, call.name, call.arguments)
            episode.messages.append(
                ChatMessage(role="tool", content=result, tool_call_id=call.id, name=call.name)
            )
        if episode.assistant_turns >= episode.max_turns:
            episode.done, episode.end_reason = True, "max_turns"

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        """The answer is re-read from the last raw completion, never from the episode."""
        self._ledger.episode_verified(task.task_id, episode)
        answer = None
        if episode.completions:
            last = parse_assistant_output(episode.completions[-1], self._tool_names(task))
            answer = last.content if not last.tool_calls else None
        conversation = prompt_text(
            [{"role": m.role, "content": _chat_text(m)} for m in episode.messages]
        )
        return self._score(task, answer, conversation=conversation)

    def chat_demonstration(
        self, task: TaskSpec, *, recover_from_slip: bool = False
    ) -> list[tuple[list[ChatMessage], str]]:
        """A successful trace's conversation replayed through this sandbox, one (messages so
        far, agent text) pair per agent turn: what bootstrap's SFT trains on
        (:mod:`.demonstrations`). A task curated from a failure has none (ValueError)."""
        if recover_from_slip:
            raise ValueError(
                "replay demonstrations are recorded conversations: recovery_fraction does not apply"
            )
        return replay_demonstration(self, task)

    # -- the sandbox --------------------------------------------------------------------

    def tool_result(self, task: TaskSpec, name: str, arguments: Mapping[str, Any] | str) -> str:
        """What the task's tool ``name`` answers to ``arguments`` (see the module docstring)."""
        return self._tool_answer(task, name, arguments).text

    def job_outputs(self, output_dir: Path) -> dict[str, Any]:
        """What the sandbox adds to a job's ``metrics.json`` (``unanswerable_calls``, each
        endpoint's usage, and ``tool_answers``, the listing of the live answers file it
        writes into ``output_dir``; see :mod:`.sandbox`)."""
        usage = {name: e.usage.to_dict() for name, e in sorted(self.live_tools.items())}
        return self._ledger.job_outputs(output_dir, usage)

    def close(self) -> None:
        """Close the live endpoints (an MCP stdio server exits)."""
        for endpoint in self.live_tools.values():
            endpoint.close()

    def _episode_tool_result(
        self,
        task: TaskSpec,
        episode: Episode | ChatEpisode,
        name: str,
        arguments: Mapping[str, Any] | str,
    ) -> str:
        answer = self._tool_answer(task, name, arguments)
        if not answer.answered:
            self._ledger.unanswered(episode)
        return answer.text

    def _tool_answer(
        self, task: TaskSpec, name: str, arguments: Mapping[str, Any] | str
    ) -> ToolAnswer:
        """In order: unknown tool, a recorded result (the task's own trace, the loop's
        store), the schema's usage error, an answer a live endpoint already gave this
        process, the loop's live endpoint, and else no result."""
        tool = next((t for t in task.tools if t.get("name") == name), None)
        if tool is None:
            return ToolAnswer(f"error: unknown tool {name}", answered=True)
        key = (name, schema_hash(tool), canonical_arguments(arguments))
        for table in (self._own_records(task), self._store(task)):
            if key in table:
                return ToolAnswer(table[key], answered=True)
        usage = usage_error(tool, arguments)
        if usage is not None:
            return ToolAnswer(usage, answered=True)
        live = self._ledger.live(key)
        if live is not None:
            return ToolAnswer(live, answered=True)
        endpoint = self._live_endpoint(task)
        if endpoint is None:
            return ToolAnswer(no_record(name), answered=False)
        answer = endpoint.answer(name, arguments_object(arguments))
        if answer.recordable:
            self._ledger.remember(RecordedCall(*key, answer.text))
        return answer

    def _live_endpoint(self, task: TaskSpec) -> LiveToolEndpoint | None:
        endpoint_name = task.verifier.get("params", {}).get("tool_endpoint")
        if not endpoint_name:
            return None
        endpoint = self.live_tools.get(endpoint_name)
        if endpoint is None:
            raise ValueError(
                f"task {task.task_id[:12]} sends unrecorded calls to tool endpoint "
                f"{endpoint_name!r}, which this process was not given "
                "(settings.tool_endpoints)"
            )
        return endpoint

    def judge_usage(self) -> dict[str, dict[str, Any]]:
        """Each judge's calls, cache hits, tokens and cost so far (the eval job reports it)."""
        return {name: judge.usage.to_dict() for name, judge in sorted(self.judges.items())}

    def _own_records(self, task: TaskSpec) -> dict[tuple[str, str, str], str]:
        """The calls the task's own trace recorded, parsed once per task (a GRPO group
        replays the same task many times)."""
        with self._lock:
            table = self._own.get(task.task_id)
        if table is None:
            replay = task.metadata.get("replay") or {}
            recorded = replay.get("recorded") or [] if isinstance(replay, Mapping) else []
            table = as_table([RecordedCall.from_dict(r) for r in recorded])
            with self._lock:
                if len(self._own) >= _OWN_MAX:
                    self._own.clear()
                self._own[task.task_id] = table
        return table

    def _store(self, task: TaskSpec) -> dict[tuple[str, str, str], str]:
        lineage = task.metadata.get("ratchet")
        path = lineage.get("tool_store") if isinstance(lineage, Mapping) else None
        if not isinstance(path, str):
            return {}
        with self._lock:
            table = self._stores.get(path)
        if table is None:
            try:
                table = read_store_file(Path(path))
            except StoreFileError as exc:
                raise ValueError(f"task {task.task_id[:12]}: {exc}") from None
            with self._lock:
                if len(self._stores) >= _STORES_MAX:
                    self._stores.clear()
                self._stores[path] = table
        return table

    # -- rewards ------------------------------------------------------------------------

    def compare_with_judges(self) -> None:
        """Ask each judge about a sample of the tasks a rule decides and count whether they
        agree (the eval job does; see :mod:`.scoring`)."""
        for judge in self.judges.values():
            judge.agreement.sampling = True

    def judge_agreement(self) -> dict[str, dict[str, int]]:
        """Each sampling judge's agreement with the rules so far (the eval job reports it)."""
        return {
            name: judge.agreement.to_dict()
            for name, judge in sorted(self.judges.items())
            if judge.agreement.sampling
        }

    def _score(self, task: TaskSpec, answer: str | None, *, conversation: str) -> Reward:
        spec = self._reward_spec(task)
        if spec["kind"] == "judge":
            return scoring.judge_reward(self.judges, task, spec, answer, conversation)
        reward = scoring.reference_reward(task, spec, answer)
        scoring.compare_with_judge(
            self.judges, task, spec.get("judge"), answer, conversation, rule_passed=reward.passed
        )
        return reward

    def _reward_spec(self, task: TaskSpec) -> dict[str, Any]:
        if task.environment != self.name or task.verifier.get("reward_id") != REWARD_ID:
            raise ValueError(f"task {task.task_id[:12]} is not a replay task")
        spec = task.verifier.get("params", {}).get("reward")
        if not isinstance(spec, Mapping) or spec.get("kind") not in ("reference", "judge"):
            raise ValueError(f"task {task.task_id[:12]} has no replay reward spec")
        return dict(spec)

    def _prefix(self, task: TaskSpec, max_turns: int) -> list[dict[str, Any]]:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self._reward_spec(task)
        replay = task.metadata.get("replay")
        prefix = replay.get("messages") if isinstance(replay, Mapping) else None
        if not isinstance(prefix, list) or not any(m.get("role") == "user" for m in prefix):
            raise ValueError(f"task {task.task_id[:12]} has no replay conversation")
        return prefix

    @staticmethod
    def _tool_names(task: TaskSpec) -> set[str]:
        return {str(t.get("name")) for t in task.tools}


def openai_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A task's tools (``ratchet.trace/v1`` form) as OpenAI function tools."""
    return [{"type": "function", "function": flat_tool(tool)} for tool in tools]


def prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation as the text a text model continues: one ``role: content`` line each."""
    lines = (f"{m['role']}: {' '.join(str(m.get('content') or '').split())}" for m in messages)
    return "".join(f"{line}\n" for line in lines)


def conversation_key(trace: Mapping[str, Any]) -> str | None:
    """The key that makes two traces "the same task": the tools' schemas and the
    conversation up to the first assistant turn (sha256 of their canonical JSON)."""
    shape = _trace_shape(trace)
    if isinstance(shape, Rejection):
        return None
    tools, messages = shape
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        return None
    prefix = [_prefix_message(m) for m in messages[:first]]
    text = json.dumps(
        {"tools": sorted((t["name"], schema_hash(t)) for t in tools), "messages": prefix},
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _trace_shape(
    trace: Mapping[str, Any],
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]]] | Rejection:
    if not isinstance(trace, Mapping):
        return Rejection("malformed_trace", "trace is not a JSON object")
    if trace.get("schema", TRACE_SCHEMA) != TRACE_SCHEMA:
        return Rejection(
            "unsupported_schema", f"trace schema {trace.get('schema')!r} is not supported"
        )
    tools, messages = trace.get("tools") or [], trace.get("messages")
    if not isinstance(tools, list) or not isinstance(messages, list):
        return Rejection("malformed_trace", "trace needs a tools list and a messages list")
    if not all(isinstance(m, Mapping) for m in messages):
        return Rejection("malformed_trace", "every message must be an object")
    flat: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            return Rejection("malformed_trace", f"tools[{index}] needs a string name")
        if not isinstance(flat_tool(tool)["parameters"], dict):
            return Rejection("malformed_trace", f"tools[{index}].parameters must be an object")
        flat.append(flat_tool(tool))
    if not flat:
        return Rejection("no_tools", "trace lists no tools: replay needs the agent's tools")
    return flat, list(messages)


def _prefix_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content")}
    if message.get("name") is not None:
        out["name"] = message.get("name")
    return out


def _chat_text(message: ChatMessage) -> str:
    calls = " ".join(
        json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        for c in message.tool_calls
    )
    return " ".join(part for part in (message.content or "", calls) if part)


__all__ = [
    "ENVIRONMENT_NAME",
    "REWARD_ID",
    "LiveToolEndpoint",
    "ReplayEnvironment",
    "conversation_key",
    "openai_tools",
    "prompt_text",
]

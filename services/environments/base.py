"""The environment interface: tasks, episodes, rewards, the task file, and the Protocol.

An environment is what turns "the agent failed in production" into something a trainer can
optimise and a gate can measure. It provides:

- tasks (:class:`TaskSpec`) — a prompt the policy sees, the tools it may call, a verifier
  (reward id + params) and optionally a reference answer, identified by its task id (a
  hash of its content);
- a rollout step — :meth:`Environment.start` opens an :class:`Episode`,
  :meth:`Environment.step` applies one agent turn (tool call or answer) and records the
  environment's reply; :func:`run_episode_with` loops the two for a single ``act`` callable;
- a verifier — :meth:`Environment.verify` scores a finished episode with a rubric
  (:class:`Reward`);
- a trace adapter — :meth:`Environment.task_from_trace` rebuilds a task from a
  ``ratchet.trace/v1`` trace, or says why it cannot (:class:`Rejection`);
- optionally task generation and demonstrations, for environments that can synthesise work.

Transcripts are plain text: the prompt, then one line per turn. Agent turns start with
``Episode.agent_prefix`` and environment replies with ``Episode.env_prefix``; the text the
policy continues is :meth:`Episode.transcript`, which ends with the agent prefix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

TASK_SCHEMA = "ratchet.task/v1"
TRACE_SCHEMA = "ratchet.trace/v1"


class TaskFileError(ValueError):
    """A task file (or one task in it) that does not follow ``ratchet.task/v1``."""


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compute_task_id(
    *,
    environment: str,
    prompt: str,
    tools: Sequence[Mapping[str, Any]],
    verifier: Mapping[str, Any],
    reference_answer: str | None,
) -> str:
    """The task id: sha256 of the task's content as canonical JSON; metadata is not content.

    The one function that computes a task id. It names a task wherever a job sees it (the
    task file's and the results rows' ``task_id``). It is not curation's dedup key
    (:func:`services.curation.similarity.dedup_key`, which hashes a whitespace-normalized
    prompt) nor the ``tasks`` row id, which the database code calls ``task_id``.
    """
    content = {
        "environment": environment,
        "prompt": prompt,
        "tools": list(tools),
        "verifier": dict(verifier),
        "reference_answer": reference_answer,
    }
    return hashlib.sha256(_canonical(content).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TaskSpec:
    """One verifiable RL task, as stored in a task file and in the tasks table.

    ``task_id`` is :func:`compute_task_id` of the content (checked on reading a task file).
    """

    task_id: str
    environment: str
    prompt: str
    tools: list[dict[str, Any]]
    verifier: dict[str, Any]
    reference_answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        *,
        environment: str,
        prompt: str,
        tools: Sequence[Mapping[str, Any]],
        verifier: Mapping[str, Any],
        reference_answer: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> TaskSpec:
        """Build a task and compute its content-hash id."""
        tools_list = [dict(t) for t in tools]
        verifier_dict = dict(verifier)
        task_id = compute_task_id(
            environment=environment,
            prompt=prompt,
            tools=tools_list,
            verifier=verifier_dict,
            reference_answer=reference_answer,
        )
        return cls(
            task_id=task_id,
            environment=environment,
            prompt=prompt,
            tools=tools_list,
            verifier=verifier_dict,
            reference_answer=reference_answer,
            metadata=dict(metadata or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": TASK_SCHEMA,
            "task_id": self.task_id,
            "environment": self.environment,
            "prompt": self.prompt,
            "tools": self.tools,
            "verifier": self.verifier,
            "reference_answer": self.reference_answer,
            "metadata": self.metadata,
        }

    def to_json(self) -> str:
        """One JSON line of the task file (``"schema": "ratchet.task/v1"``)."""
        return _canonical(self.to_dict())

    @classmethod
    def from_json(cls, data: str | Mapping[str, Any]) -> TaskSpec:
        """Parse one task (a JSON line or an already decoded object); validate every field."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"not valid JSON: {exc.msg}") from exc
        if not isinstance(data, Mapping):
            raise TaskFileError("a task must be a JSON object")
        if data.get("schema") != TASK_SCHEMA:
            raise TaskFileError(f"schema must be {TASK_SCHEMA!r}, got {data.get('schema')!r}")
        _require(data, "task_id", str)
        _require(data, "environment", str)
        _require(data, "prompt", str)
        _require(data, "tools", list)
        _require(data, "verifier", dict)
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in data["tools"]):
            raise TaskFileError("every tool must be an object with a string 'name'")
        verifier = data["verifier"]
        if not isinstance(verifier.get("reward_id"), str) or not isinstance(
            verifier.get("params", {}), dict
        ):
            raise TaskFileError("verifier must be {'reward_id': str, 'params': object}")
        reference = data.get("reference_answer")
        if reference is not None and not isinstance(reference, str):
            raise TaskFileError("reference_answer must be a string or null")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TaskFileError("metadata must be an object")
        task = cls.create(
            environment=data["environment"],
            prompt=data["prompt"],
            tools=data["tools"],
            verifier=verifier,
            reference_answer=reference,
            metadata=metadata,
        )
        if task.task_id != data["task_id"]:
            raise TaskFileError(
                f"task_id {data['task_id'][:12]}… does not match the task's content hash"
            )
        return task


def _require(data: Mapping[str, Any], key: str, kind: type) -> None:
    if not isinstance(data.get(key), kind):
        raise TaskFileError(f"field {key!r} must be a {kind.__name__}")


def write_task_file(path: Path | str, tasks: Iterable[TaskSpec]) -> int:
    """Write tasks as JSONL (one ``ratchet.task/v1`` object per line); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w", encoding="utf-8") as fh:
        for task in tasks:
            fh.write(task.to_json() + "\n")
            count += 1
    return count


def read_task_file(path: Path | str) -> list[TaskSpec]:
    """Read a JSONL task file; a bad line raises :class:`TaskFileError` naming its number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TaskFileError(f"cannot read task file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"task file {path} is not UTF-8: {exc}") from exc
    tasks: list[TaskSpec] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            tasks.append(TaskSpec.from_json(line))
        except TaskFileError as exc:
            raise TaskFileError(f"{path}: line {number}: {exc}") from exc
    return tasks


@dataclass(frozen=True)
class Rejection:
    """Why a trace cannot become a task: a stable reason code and a human message."""

    reason: str
    message: str


@dataclass(frozen=True)
class Reward:
    """A rubric score: named components in [0, 1], their weighted total, and pass/fail."""

    components: dict[str, float]
    total: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"components": self.components, "total": self.total, "passed": self.passed}


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the name the agent used and its arguments."""

    call_id: str
    name: str
    arguments: dict[str, Any] | str


@dataclass
class Turn:
    """One line of the transcript: an agent turn or the environment's reply to it."""

    role: Literal["agent", "env"]
    text: str
    tool_call: ToolCall | None = None
    answer: str | None = None
    error: str | None = None
    truncated: bool = False  # an agent turn cut at the generation limit (no stop byte sampled)


@dataclass
class Episode:
    """A rollout in progress or finished: the prompt, the turns, and why it ended."""

    task_id: str
    prompt: str
    system: str | None
    user: str
    max_turns: int
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    end_reason: str | None = None
    agent_prefix: str = "> "
    env_prefix: str = "= "

    @property
    def agent_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.role == "agent"]

    @property
    def final_answer(self) -> str | None:
        for turn in reversed(self.turns):
            if turn.role == "agent" and turn.answer is not None:
                return turn.answer
        return None

    def render_turn(self, turn: Turn) -> str:
        prefix = self.agent_prefix if turn.role == "agent" else self.env_prefix
        return f"{prefix}{turn.text}\n"

    def transcript(self) -> str:
        """The text the policy continues: prompt, turns so far, and the agent prefix."""
        return self.prompt + "".join(self.render_turn(t) for t in self.turns) + self.agent_prefix

    def full_text(self) -> str:
        """The whole episode as text (no trailing agent prefix)."""
        return self.prompt + "".join(self.render_turn(t) for t in self.turns)

    def to_trace_messages(self) -> list[dict[str, Any]]:
        """The episode as ``ratchet.trace/v1`` messages (system, user, assistant, tool)."""
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": self.user})
        last_call: ToolCall | None = None
        for turn in self.turns:
            if turn.role == "agent":
                last_call = turn.tool_call
                if turn.tool_call is not None:
                    call = turn.tool_call
                    messages.append(
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {"id": call.call_id, "name": call.name, "arguments": call.arguments}
                            ],
                        }
                    )
                else:
                    messages.append({"role": "assistant", "content": turn.answer or turn.text})
            else:
                message: dict[str, Any] = {"role": "tool", "content": turn.text}
                if last_call is not None:
                    message["tool_call_id"] = last_call.call_id
                    message["name"] = last_call.name
                messages.append(message)
        return messages


def build_trace(
    task: TaskSpec,
    episode: Episode,
    reward: Reward,
    *,
    external_id: str,
    model_version: str | None = None,
    started_at: str | None = None,
    ended_at: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A complete ``ratchet.trace/v1`` document for an episode, as a runtime would post it.

    The outcome reports what production would know (did the answer check out); the trace
    carries no reference answer, so curation has to recompute it.
    """
    error = None
    if not reward.passed:
        error = {"kind": episode.end_reason or "wrong_answer", "message": "answer was not accepted"}
    return {
        "schema": TRACE_SCHEMA,
        "external_id": external_id,
        "model_version": model_version,
        "started_at": started_at,
        "ended_at": ended_at,
        "tools": task.tools,
        "messages": episode.to_trace_messages(),
        "outcome": {"success": reward.passed, "score": reward.total, "error": error},
        "reference_answer": None,
        "metadata": {**task.metadata, **dict(metadata or {})},
    }


def user_request(messages: Sequence[object]) -> str | Rejection:
    """The text of a trace's first user message: the request a task is made from.

    Every environment that turns traces into tasks reads the request this way, so a trace
    without one is refused alike (``no_user_message``) whichever environment curates it.
    """
    request = next(
        (m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"),
        None,
    )
    if not isinstance(request, str) or not request.strip():
        return Rejection("no_user_message", "trace has no user message with text")
    return request


Act = Callable[[str], str]


@runtime_checkable
class Environment(Protocol):
    """What Ratchet needs from an environment. See docs/environments.md."""

    name: str

    def generate_tasks(self, n: int, *, seed: int, api_version: str) -> list[TaskSpec]:
        """``n`` distinct tasks, deterministic in ``seed`` (optional: may raise
        NotImplementedError)."""
        ...

    def start(self, task: TaskSpec, *, max_turns: int) -> Episode:
        """Open an episode on ``task``: no turns yet."""
        ...

    def step(self, task: TaskSpec, episode: Episode, action: str) -> None:
        """Apply one agent turn ``action`` to ``episode`` and record the environment's reply."""
        ...

    def run_episode(self, task: TaskSpec, act: Act, *, max_turns: int) -> Episode:
        """Roll out one episode: ``act`` maps the transcript so far to the agent's next turn."""
        ...

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        """Score a finished episode with the task's verifier."""
        ...

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        """Rebuild a verifiable task from a ``ratchet.trace/v1`` trace, or say why not."""
        ...

    def demonstrations(
        self, tasks: Sequence[TaskSpec], *, seed: int, augment_fraction: float = 0.0
    ) -> list[Episode]:
        """Solved episodes for SFT (optional: may raise NotImplementedError).

        ``augment_fraction`` is the share of demonstrations that use an environment-specific
        variation (toolcalc: tools called by their aliases).
        """
        ...


def run_episode_with(env: Environment, task: TaskSpec, act: Act, *, max_turns: int) -> Episode:
    """The rollout loop every environment shares: start, then step until done."""
    episode = env.start(task, max_turns=max_turns)
    while not episode.done:
        env.step(task, episode, act(episode.transcript()))
    return episode

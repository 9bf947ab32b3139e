"""The toolcalc environment: rollout step, rubric verifier, trace adapter, demonstrations.

Transcript of a solved v1 episode (the policy continues the text after each ``> ``)::

    tools: #add(a,b) &mul(a,b) @get(item)
    user: $pear*37
    > @get(pear)
    = 12
    > &mul(12,37)
    = 444
    > ans 444

The rubric (weights sum to 1):

- ``syntax`` (0.1): share of the agent's tool calls that are well-formed for the task's API
  version (known tool name, right number and kind of arguments, right separator);
- ``tools`` (0.2): share of the task's program (the calls that solve it) that the agent made
  with the right tool and arguments;
- ``answer`` (0.7): the final ``ans`` equals the value recomputed from the request.

A task passes when the answer is right: partial credit shapes learning, it never passes.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from services.chat.protocol import ChatMessage
from services.chat.protocol import ToolCall as ChatToolCall
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
from services.environments.toolcalc import chat
from services.environments.toolcalc.api import (
    CallError,
    Op,
    ParsedCall,
    ToolAPI,
    deprecation_window,
    get_api,
    infer_api_version_from_specs,
)
from services.environments.toolcalc.tasks import (
    PRICES,
    Program,
    UnverifiableRequest,
    normalize_request,
    sample_request,
    solve,
)

ENVIRONMENT_NAME = "toolcalc"
REWARD_ID = "toolcalc/rubric-v1"
WEIGHTS = {"syntax": 0.1, "tools": 0.2, "answer": 0.7}
DEFAULT_MAX_TURNS = 5
MIGRATED_SHARE = 0.25  # agents already using v2's names during its deprecation window

_ANSWER = re.compile(r"^ans\s+(.*)$")
_NOT_A_TURN = "error: expected name(args) or ans <number>"


class ToolcalcEnvironment:
    """Arithmetic and price lookups through a drifting tool API (see :mod:`.api`)."""

    name = ENVIRONMENT_NAME

    # -- tasks --------------------------------------------------------------------------

    def make_task(
        self, request: str, api_version: str, *, metadata: Mapping[str, Any] | None = None
    ) -> TaskSpec:
        """The task for one request under one API version; raises UnverifiableRequest."""
        api = get_api(api_version)
        request = normalize_request(request)
        program = solve(request, api)
        return TaskSpec.create(
            environment=self.name,
            prompt=f"{api.listing()}\nuser: {request}\n",
            tools=api.tool_specs(),
            verifier={
                "reward_id": REWARD_ID,
                "params": {"request": request, "api_version": api_version},
            },
            reference_answer=str(program.answer),
            metadata={"environment": self.name, "api_version": api_version, **dict(metadata or {})},
        )

    def generate_tasks(self, n: int, *, seed: int, api_version: str = "v1") -> list[TaskSpec]:
        """``n`` distinct tasks (by content hash), deterministic in ``seed``."""
        if n < 0:
            raise ValueError("n must be >= 0")
        get_api(api_version)
        rng = random.Random(f"toolcalc/{api_version}/{seed}")
        tasks: dict[str, TaskSpec] = {}
        attempts = 0
        while len(tasks) < n:
            attempts += 1
            if attempts > 50 * n + 100:
                raise ValueError(f"cannot generate {n} distinct toolcalc tasks")
            task = self.make_task(sample_request(rng), api_version)
            tasks.setdefault(task.task_id, task)
        return list(tasks.values())

    # -- rollout ------------------------------------------------------------------------

    def start(self, task: TaskSpec, *, max_turns: int = DEFAULT_MAX_TURNS) -> Episode:
        api, request = self._episode_start(task, max_turns)
        return Episode(
            task_id=task.task_id,
            prompt=task.prompt,
            system=api.listing(),
            user=request,
            max_turns=max_turns,
        )

    def step(self, task: TaskSpec, episode: Episode, action: str) -> None:
        if episode.done:
            raise ValueError("episode is already done")
        api, _ = self._task_api(task)
        self._apply(api, episode, action)

    def run_episode(
        self, task: TaskSpec, act: Act, *, max_turns: int = DEFAULT_MAX_TURNS
    ) -> Episode:
        return run_episode_with(self, task, act, max_turns=max_turns)

    def _apply(self, api: ToolAPI, episode: Episode, action: str) -> None:
        """Record the agent turn and the environment's reply; end on an answer or max turns."""
        raw = action.replace("\n", " ")  # one turn is one transcript line
        text = raw.strip()
        call_id = f"call_{len(episode.agent_turns) + 1}"
        answer = _ANSWER.match(text)
        if answer is not None:
            episode.turns.append(Turn("agent", raw, answer=answer.group(1).strip()))
            episode.done, episode.end_reason = True, "answered"
            return
        parsed = api.parse_call(text)
        if parsed is None:
            episode.turns.append(Turn("agent", raw))
            episode.turns.append(Turn("env", _NOT_A_TURN, error="not_a_turn"))
        elif isinstance(parsed, CallError):
            call = ToolCall(call_id, parsed.name or "", parsed.raw_args or "")
            episode.turns.append(Turn("agent", raw, tool_call=call))
            episode.turns.append(Turn("env", parsed.message, error="bad_call"))
        else:
            call = ToolCall(call_id, parsed.name, dict(parsed.args))
            episode.turns.append(Turn("agent", raw, tool_call=call))
            result, error = _execute(parsed)
            episode.turns.append(Turn("env", result, error=error))
        if len(episode.agent_turns) >= episode.max_turns:
            episode.done, episode.end_reason = True, "max_turns"

    # -- verifier -----------------------------------------------------------------------

    def verify(self, task: TaskSpec, episode: Episode) -> Reward:
        """Rubric reward; agent turns are re-parsed from their text, never trusted."""
        api, request = self._task_api(task)
        program = solve(request, api)
        parsed = [api.parse_call(t.text) for t in episode.agent_turns if t.answer is None]
        calls = [p for p in parsed if p is not None]
        well_formed = [p for p in calls if isinstance(p, ParsedCall)]
        syntax = len(well_formed) / len(calls) if calls else 0.0
        required = Counter(program.calls)
        made = Counter(_as_program_call(p) for p in well_formed)
        tools = sum((required & made).values()) / len(program.calls)
        answer = 1.0 if _answer_matches(episode.final_answer, program) else 0.0
        components = {"syntax": syntax, "tools": tools, "answer": answer}
        total = sum(WEIGHTS[k] * v for k, v in components.items())
        return Reward(components=components, total=round(total, 6), passed=answer == 1.0)

    def _episode_start(self, task: TaskSpec, max_turns: int) -> tuple[ToolAPI, str]:
        """What a text episode and a chat episode both start from: the task's API version and
        request, given a turn budget an episode can use."""
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        return self._task_api(task)

    def _task_api(self, task: TaskSpec) -> tuple[ToolAPI, str]:
        if task.environment != self.name:
            raise ValueError(
                f"task {task.task_id[:12]} belongs to {task.environment!r}, not toolcalc"
            )
        params = task.verifier.get("params", {})
        if task.verifier.get("reward_id") != REWARD_ID or not isinstance(
            params.get("request"), str
        ):
            raise ValueError(f"task {task.task_id[:12]} has no toolcalc verifier")
        return get_api(str(params.get("api_version"))), params["request"]

    # -- trace adapter ------------------------------------------------------------------

    def task_from_trace(self, trace: Mapping[str, Any]) -> TaskSpec | Rejection:
        """Rebuild the task behind a ``ratchet.trace/v1`` toolcalc trace.

        The answer is recomputed from the user's request; the trace's claimed answer and
        outcome are never trusted. The API version comes from ``metadata.api_version`` or,
        when absent, from the trace's tool list.
        """
        if not isinstance(trace, Mapping):
            return Rejection("malformed_trace", "trace is not a JSON object")
        if trace.get("schema", TRACE_SCHEMA) != TRACE_SCHEMA:
            return Rejection(
                "unsupported_schema", f"trace schema {trace.get('schema')!r} is not supported"
            )
        metadata = trace.get("metadata") or {}
        tools = trace.get("tools") or []
        messages = trace.get("messages")
        if (
            not isinstance(metadata, Mapping)
            or not isinstance(tools, list)
            or not isinstance(messages, list)
        ):
            return Rejection(
                "malformed_trace", "trace needs metadata object, tools list and messages list"
            )
        environment = metadata.get("environment", self.name)
        if environment != self.name:
            return Rejection("wrong_environment", f"trace is from environment {environment!r}")
        version = self._trace_api_version(metadata, tools)
        if isinstance(version, Rejection):
            return version
        request = user_request(messages)
        if isinstance(request, Rejection):
            return request
        # A chat agent's user asks in words (.chat.user_message); a text agent's, in the
        # expression itself.
        request = chat.request_from_words(request) or request
        source = {
            "external_id": trace.get("external_id"),
            "model_version": trace.get("model_version"),
        }
        try:
            return self.make_task(request, version, metadata={"source": source})
        except UnverifiableRequest as exc:
            return Rejection(exc.reason, str(exc))

    def _trace_api_version(self, metadata: Mapping[str, Any], tools: list[Any]) -> str | Rejection:
        specs = [t for t in tools if isinstance(t, dict)]
        inferred = infer_api_version_from_specs(specs) if specs else None
        claimed = metadata.get("api_version")
        if claimed is not None:
            try:
                get_api(str(claimed))
            except ValueError as exc:
                return Rejection("unknown_api_version", str(exc))
            if inferred is not None and inferred != claimed:
                return Rejection(
                    "api_version_mismatch",
                    f"metadata says API {claimed} but the tool list is API {inferred}",
                )
            return str(claimed)
        if inferred is None:
            names = sorted(str(t.get("name")) for t in specs)
            return Rejection(
                "unknown_api_version", f"tool list {names} matches no toolcalc API version"
            )
        return inferred

    # -- chat (OpenAI messages + tools, for the hf family; see .chat) ----------------------

    def chat_start(self, task: TaskSpec, *, max_turns: int = DEFAULT_MAX_TURNS) -> ChatEpisode:
        api, request = self._episode_start(task, max_turns)
        return ChatEpisode(
            task_id=task.task_id,
            messages=chat.start_messages(request),
            tools=chat.openai_tools(api),
            max_turns=max_turns,
        )

    def chat_step(
        self, task: TaskSpec, episode: ChatEpisode, completion: str, *, truncated: bool = False
    ) -> None:
        if episode.done:
            raise ValueError("episode is already done")
        api, _ = self._task_api(task)
        chat.apply_completion(api, episode, completion, truncated=truncated, execute=_execute)

    def chat_verify(self, task: TaskSpec, episode: ChatEpisode) -> Reward:
        """Rubric reward recomputed from the request and the raw completions only."""
        api, request = self._task_api(task)
        return chat.verify_completions(api, solve(request, api), list(episode.completions))

    def chat_demonstration(
        self, task: TaskSpec, *, recover_from_slip: bool = False
    ) -> list[tuple[list[ChatMessage], str]]:
        """The solved conversation, one (messages so far, assistant text) pair per turn.

        ``recover_from_slip``: the first call is first made without its last argument, gets
        the API's usage error, and is then made right, as in an agent's production traces.
        The slip is context, never a target: the model sees a tool's error followed, and
        under an API change it was never shown it varies its calls instead of repeating one
        (docs/models.md, run 4; it did not yet reach the answers there).
        """
        api, request = self._task_api(task)
        program = solve(request, api)
        turns = len(program.calls) + 1 + int(recover_from_slip)
        episode = self.chat_start(task, max_turns=turns)
        pairs: list[tuple[list[ChatMessage], str]] = []
        for index, (op, args) in enumerate(program.calls):
            tool = api.by_op(op)
            arguments = dict(zip(tool.params, args, strict=True))
            if recover_from_slip and index == 0:
                slip = dict(list(arguments.items())[:-1])
                slip_call = ChatToolCall(id="", name=tool.name, arguments=slip)
                self.chat_step(task, episode, chat.demonstration_text(slip_call))
            text = chat.demonstration_text(ChatToolCall(id="", name=tool.name, arguments=arguments))
            pairs.append((list(episode.messages), text))
            self.chat_step(task, episode, text)
        pairs.append((list(episode.messages), str(program.answer)))
        self.chat_step(task, episode, str(program.answer))
        return pairs

    # -- demonstrations -----------------------------------------------------------------

    def demonstration(
        self, task: TaskSpec, *, api: ToolAPI | None = None, use_aliases: bool = False
    ) -> Episode:
        """The solved episode for ``task``, optionally under another API (same request).

        ``use_aliases`` calls the tools by the API's aliases (old or announced names).
        """
        task_api, request = self._task_api(task)
        api = api or task_api
        program = solve(request, api)
        prompt = task.prompt if api is task_api else f"{api.listing()}\nuser: {request}\n"
        episode = Episode(task.task_id, prompt, api.listing(), request, len(program.calls) + 1)
        for op, args in program.calls:
            self._apply(api, episode, api.format_call(op, args, use_alias=use_aliases))
        self._apply(api, episode, f"ans {program.answer}")
        return episode

    def demonstrations(
        self, tasks: Sequence[TaskSpec], *, seed: int, augment_fraction: float = 0.0
    ) -> list[Episode]:
        """Solved episodes; a share ``augment_fraction`` of the v1 tasks as seen in v2's
        deprecation window.

        That is last month's traffic as it looked: the listing already showed v2's names,
        the old names still worked, and most agents (all but ``MIGRATED_SHARE``) kept
        using them. Other API versions have no window and are demonstrated as they are.
        """
        if not 0.0 <= augment_fraction <= 1.0:
            raise ValueError("augment_fraction must be in [0, 1]")
        rng = random.Random(f"toolcalc/demos/{seed}")
        window = deprecation_window("v1", "v2")
        episodes = []
        for task in tasks:
            in_window = rng.random() < augment_fraction
            migrated = rng.random() < MIGRATED_SHARE
            if in_window and self._task_api(task)[0].version == "v1":
                episodes.append(self.demonstration(task, api=window, use_aliases=not migrated))
            else:
                episodes.append(self.demonstration(task))
        return episodes


def _execute(call: ParsedCall) -> tuple[str, str | None]:
    """Run a well-formed call: (result text, error code or None)."""
    args = call.args
    if call.tool.op == "add":
        return str(args["a"] + args["b"]), None
    if call.tool.op == "mul":
        return str(args["a"] * args["b"]), None
    currency = args.get("cur", "usd")
    if currency not in PRICES:
        return f"error: unknown currency {currency}", "bad_argument"
    price = PRICES[currency].get(args["item"])
    if price is None:
        return f"error: unknown item {args['item']}", "bad_argument"
    return str(price), None


def _as_program_call(call: ParsedCall) -> tuple[Op, tuple[Any, ...]]:
    return call.tool.op, tuple(call.args[p] for p in call.tool.params)


def _answer_matches(answer: str | None, program: Program) -> bool:
    if answer is None or not re.fullmatch(r"-?\d{1,12}", answer):
        return False
    return int(answer) == program.answer

"""Simulated production traffic for `ratchet demo` and the loop benchmark: an OpenAI agent.

Each "user" asks a toolcalc question under the tool API in force. The agent is written the
way users write theirs, with the official ``openai`` client and a tool loop
(:class:`ToolcalcAgent`): it sends the conversation and the tools to the served model
(``ratchet serve``, vLLM, any OpenAI-compatible server), runs the tool calls it gets back
against the tool API, sends the results as ``tool`` messages, and stops at an answer. The
episode then goes to Ratchet as production traces do:

- ``transport="webhook"`` (default): a signed ``ratchet.trace/v1`` trace, batched, posted
  with ``clients/python``'s ``TraceClient`` (the client users post with);
- ``transport="otlp"``: OpenTelemetry GenAI spans (``invoke_agent``, one ``chat`` span per
  model call, ``execute_tool`` spans, the outcome) through the OTLP door with the loop's
  ingest token, as an instrumented agent runtime exports them.

Whether the answer was right is known here (the user's question has one answer), so every
trace carries its outcome; the demo also keeps the outcomes to plot the live success rate.

The conversation is the served family's: the tiny GPT reads toolcalc's transcript listing
(``style="transcript"``: the listing as the system message, the request as the user
message), chat models read toolcalc's chat rendering (``style="chat"``).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, Literal

import openai
from ratchet_client import TraceClient

from services.chat.protocol import ToolCall as ChatToolCall
from services.environments import get_environment
from services.environments.base import TaskSpec
from services.environments.toolcalc.api import CallError, get_api
from services.environments.toolcalc.chat import check_call, extract_answer
from services.environments.toolcalc.tasks import PRICES, solve
from services.modelserver.openai_api import VERSION_HEADER

logger = logging.getLogger(__name__)

Style = Literal["transcript", "chat"]
Transport = Literal["webhook", "otlp"]
AGENT_NAME = "toolcalc-agent"


@dataclass(frozen=True)
class Outcome:
    """One production episode as the demo saw it."""

    at: float  # seconds since the traffic started
    api_version: str
    model_version: str
    success: bool


@dataclass
class TrafficStats:
    outcomes: list[Outcome] = field(default_factory=list)
    posted: int = 0
    post_errors: int = 0
    act_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def success_rate(
        self,
        *,
        since: float = 0.0,
        api_version: str | None = None,
        model_version: str | None = None,
        last: int | None = None,
    ) -> tuple[float | None, int]:
        """Success rate (and count) of the outcomes matching the filters."""
        with self._lock:
            picked = [
                o
                for o in self.outcomes
                if o.at >= since
                and (api_version is None or o.api_version == api_version)
                and (model_version is None or o.model_version == model_version)
            ]
        if last is not None:
            picked = picked[-last:]
        if not picked:
            return None, 0
        return sum(o.success for o in picked) / len(picked), len(picked)


@dataclass
class ModelCall:
    """One chat completion of an episode: what went in, what came out, when."""

    input_messages: list[dict[str, Any]]
    output: dict[str, Any]
    finish_reason: str | None
    usage: dict[str, int]
    started_ns: int
    ended_ns: int
    response_id: str  # the model server's id of the completion (signed for its version)


@dataclass
class ToolRun:
    call_id: str
    name: str
    arguments: dict[str, Any]
    result: str
    started_ns: int
    ended_ns: int


@dataclass
class AgentEpisode:
    """What the agent did for one question."""

    task: TaskSpec
    api_version: str
    messages: list[dict[str, Any]]  # OpenAI wire form, the whole conversation
    tools: list[dict[str, Any]]  # OpenAI function tools
    model_calls: list[ModelCall]
    tool_runs: list[ToolRun]
    answer: str | None
    success: bool
    model_version: str
    started_at: dt.datetime
    ended_at: dt.datetime


def toolcalc_conversation(task: TaskSpec, style: Style) -> tuple[list[dict[str, Any]], list[Any]]:
    """The opening messages and the OpenAI tools for ``task`` in the served family's style."""
    environment = get_environment(task.environment)
    if style == "chat":
        episode = environment.chat_start(task, max_turns=5)  # type: ignore[attr-defined]
        return episode.openai_messages(), list(episode.tools)
    text = environment.start(task, max_turns=5)
    tools = [{"type": "function", "function": dict(spec)} for spec in task.tools]
    return [
        {"role": "system", "content": text.system},
        {"role": "user", "content": text.user},
    ], tools


class ToolcalcTools:
    """toolcalc's tool API as the production service the agent calls (one API version)."""

    def __init__(self, api_version: str) -> None:
        self.api = get_api(api_version)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's reply, or the error the API gives for a bad call."""
        checked = check_call(self.api, ChatToolCall(id="", name=name, arguments=arguments))
        if isinstance(checked, CallError):
            return checked.message
        args = checked.args
        if checked.tool.op == "add":
            return str(args["a"] + args["b"])
        if checked.tool.op == "mul":
            return str(args["a"] * args["b"])
        price = PRICES.get(args.get("cur", "usd"), {}).get(args["item"])
        return str(price) if price is not None else f"error: unknown item {args['item']}"


@dataclass(frozen=True)
class ToolcalcAgent:
    """An agent with the ``openai`` client and a tool loop (what users copy from the docs)."""

    client: openai.OpenAI
    _: KW_ONLY
    model: str
    style: Style = "transcript"
    max_turns: int = 5
    max_tokens: int = 48
    temperature: float = 0.0

    def run(self, task: TaskSpec, api_version: str) -> AgentEpisode:
        """Answer ``task``'s question; raises ``openai.APIError`` if the model server fails."""
        started_at = dt.datetime.now(dt.UTC)
        messages, tools = toolcalc_conversation(task, self.style)
        service = ToolcalcTools(api_version)
        calls: list[ModelCall] = []
        runs: list[ToolRun] = []
        answer: str | None = None
        version = "unknown"
        for _ in range(self.max_turns):
            begun = time.time_ns()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=messages,  # type: ignore[arg-type]
                    tools=tools,
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                )
            except openai.BadRequestError as exc:
                if exc.code != "context_length_exceeded":
                    raise
                break  # the conversation outgrew the model: the episode ends unanswered
            completion = raw.parse()
            version = raw.headers.get(VERSION_HEADER) or completion.system_fingerprint or version
            choice = completion.choices[0]
            reply = choice.message.model_dump(exclude_none=True, include={"role", "content"})
            reply.setdefault("content", None)
            tool_calls = choice.message.tool_calls or []
            if tool_calls:
                reply["tool_calls"] = [call.model_dump() for call in tool_calls]
            usage = completion.usage
            calls.append(
                ModelCall(
                    input_messages=list(messages),
                    output=reply,
                    finish_reason=choice.finish_reason,
                    usage={
                        "input_tokens": usage.prompt_tokens if usage else 0,
                        "output_tokens": usage.completion_tokens if usage else 0,
                    },
                    started_ns=begun,
                    ended_ns=time.time_ns(),
                    response_id=completion.id,
                )
            )
            messages = [*messages, reply]
            if not tool_calls:
                answer = choice.message.content
                break
            for call in tool_calls:
                if call.type != "function":
                    continue
                arguments = _arguments(call.function.arguments)
                begun = time.time_ns()
                result = service.call(call.function.name, arguments)
                runs.append(
                    ToolRun(call.id, call.function.name, arguments, result, begun, time.time_ns())
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        request = str(task.verifier.get("params", {}).get("request", ""))
        expected = solve(request, service.api).answer
        return AgentEpisode(
            task=task,
            api_version=api_version,
            messages=messages,
            tools=tools,
            model_calls=calls,
            tool_runs=runs,
            answer=answer,
            success=extract_answer(answer) == expected,
            model_version=version,
            started_at=started_at,
            ended_at=dt.datetime.now(dt.UTC),
        )


@dataclass(frozen=True)
class ServedModel:
    """The model server the agent calls (``ratchet serve``, vLLM, any OpenAI-compatible
    server): its URL, its key (RATCHET_SERVE_API_KEY) when it has one, the served model's
    name, the conversation style the served family reads and the agent's temperature."""

    url: str
    api_key: str | None = None
    model: str = "ratchet"
    style: Style = "transcript"
    temperature: float = 0.0  # what the agent asks for (0: greedy)


@dataclass(frozen=True)
class TraceDestination:
    """Where the episodes go: a loop on Ratchet's api, as signed webhook traces in batches
    of ``batch_size``, or with ``transport="otlp"`` as spans through the OTLP door, which
    takes the loop's ``ingest_token``."""

    api_url: str
    loop: str
    signing_secret: str
    transport: Transport = "webhook"
    ingest_token: str | None = None
    batch_size: int = 4

    def __post_init__(self) -> None:
        if self.transport == "otlp" and not self.ingest_token:
            raise ValueError("transport 'otlp' needs the loop's ingest_token")


class TrafficSimulator:
    """Runs ``rate_per_s`` agent episodes per second from ``workers`` threads until stopped."""

    def __init__(
        self,
        *,
        served: ServedModel,
        destination: TraceDestination,
        api_version: Callable[[], str],
        rate_per_s: float = 4.0,
        workers: int = 2,
        environment: str = "toolcalc",
        seed: int = 0,
    ) -> None:
        """``api_version`` names the tool API in force for each new episode (the demo moves
        it to drift the API under the agent)."""
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be > 0")
        self.stats = TrafficStats()
        self._served = replace(served, url=served.url.rstrip("/"))
        self._destination = destination
        self._api_version = api_version
        self._interval = workers / rate_per_s
        self._workers = workers
        self._environment = get_environment(environment)
        self._seed = seed
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = time.monotonic()

    def start(self) -> None:
        self._started = time.monotonic()
        for index in range(self._workers):
            thread = threading.Thread(
                target=self._run, args=(index,), name=f"traffic-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads.clear()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _run(self, index: int) -> None:
        rng = random.Random(f"traffic/{self._seed}/{index}")
        served, destination = self._served, self._destination
        key, base = served.api_key or "unused", f"{served.url}/v1"
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        agent = ToolcalcAgent(
            client, model=served.model, style=served.style, temperature=served.temperature
        )
        token = destination.ingest_token
        exporter = OtlpExport(destination.api_url, token) if token else None
        pending: list[dict[str, Any]] = []
        traces = TraceClient(
            destination.api_url,
            destination.loop,
            destination.signing_secret,
            max_retries=3,
            max_retry_after_s=30.0,
        )
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                episode = self._one_episode(agent, rng)
                if episode is not None and destination.transport == "otlp" and exporter is not None:
                    self._export(exporter, episode)
                elif episode is not None:
                    pending.append(episode_trace(episode))
                if len(pending) >= destination.batch_size:
                    self._post(traces, pending)
                    pending = []
                self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))
            if pending:
                self._post(traces, pending)
        finally:
            traces.close()
        client.close()
        if exporter is not None:
            exporter.shutdown()

    def _one_episode(self, agent: ToolcalcAgent, rng: random.Random) -> AgentEpisode | None:
        version = self._api_version()
        seed = rng.randrange(2**31)
        task = self._environment.generate_tasks(1, seed=seed, api_version=version)[0]
        try:
            episode = agent.run(task, version)
        except openai.APIError as exc:
            self.stats.act_errors += 1
            logger.warning("the model server did not answer: %s", exc)
            return None
        self.stats.add(Outcome(self.elapsed(), version, episode.model_version, episode.success))
        return episode

    def _post(self, client: TraceClient, traces: list[dict[str, Any]]) -> None:
        """One signed batch through ``clients/python``'s TraceClient, as a user's agent posts;
        it retries a 429/503 after the api's Retry-After."""
        try:
            client.post(traces)
            self.stats.posted += len(traces)
        except Exception as exc:  # the demo keeps going; the count shows it
            self.stats.post_errors += len(traces)
            logger.warning("posting %d traces failed: %s", len(traces), exc)

    def _export(self, exporter: OtlpExport, episode: AgentEpisode) -> None:
        if exporter.export(episode):
            self.stats.posted += 1
        else:
            self.stats.post_errors += 1


def episode_trace(episode: AgentEpisode) -> dict[str, Any]:
    """The episode as a ``ratchet.trace/v1`` trace (what an agent runtime would post)."""
    passed = episode.success
    return {
        "schema": "ratchet.trace/v1",
        "external_id": f"demo-{uuid.uuid4().hex}",
        "model_version": episode.model_version,
        "response_ids": [call.response_id for call in episode.model_calls],
        "started_at": episode.started_at.isoformat(),
        "ended_at": episode.ended_at.isoformat(),
        "tools": [_function(tool) for tool in episode.tools],
        "messages": [_trace_message(m) for m in episode.messages],
        "outcome": {
            "success": passed,
            "score": 1.0 if passed else 0.0,
            "error": None if passed else {"kind": "wrong_answer", "message": "wrong answer"},
        },
        "reference_answer": None,
        "metadata": {"environment": episode.task.environment, "api_version": episode.api_version},
    }


class OtlpExport:
    """OpenTelemetry GenAI spans of episodes, exported to Ratchet's OTLP door.

    One tracer provider per traffic thread, flushed after each episode: an exporter sends
    an episode's spans together with its root, which is what the door assembles."""

    def __init__(self, api_url: str, ingest_token: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise RuntimeError(
                "transport 'otlp' needs opentelemetry-sdk and "
                "opentelemetry-exporter-otlp-proto-http (pip install them)"
            ) from exc

        exporter = OTLPSpanExporter(
            endpoint=f"{api_url.rstrip('/')}/otlp/v1/traces",
            headers={"Authorization": f"Bearer {ingest_token}"},
            timeout=30,
        )
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": "ratchet-demo-agent"})
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=60_000)
        )
        self._tracer = self._provider.get_tracer("ratchet.demo.traffic")

    def export(self, episode: AgentEpisode) -> bool:
        """Record the episode's spans and send them now; whether the export succeeded."""
        record_spans(self._tracer, episode)
        return bool(self._provider.force_flush(30_000))

    def shutdown(self) -> None:
        self._provider.shutdown()


def record_spans(tracer: Any, episode: AgentEpisode) -> None:
    """The GenAI semantic-convention spans of one episode (``gen_ai.*`` attributes)."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import Status, StatusCode

    tools = json.dumps([_function(t) for t in episode.tools])
    start = int(episode.started_at.timestamp() * 1e9)
    agent = tracer.start_span(
        f"invoke_agent {AGENT_NAME}",
        start_time=start,
        attributes={
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": AGENT_NAME,
            "gen_ai.tool.definitions": tools,
            "ratchet.external_id": f"demo-{uuid.uuid4().hex}",
            "ratchet.model_version": episode.model_version,
            "ratchet.outcome.success": episode.success,
            "ratchet.outcome.score": 1.0 if episode.success else 0.0,
        },
    )
    context = otel_trace.set_span_in_context(agent)
    events: list[ModelCall | ToolRun] = [*episode.model_calls, *episode.tool_runs]
    for item in sorted(events, key=lambda event: event.started_ns):
        if isinstance(item, ModelCall):
            name, attributes = _chat_span(episode, item, tools)
        else:
            name, attributes = _tool_span(item)
        span = tracer.start_span(
            name, context=context, start_time=item.started_ns, attributes=attributes
        )
        span.end(end_time=item.ended_ns)
    if not episode.success:
        agent.set_attribute("error.type", "wrong_answer")
        agent.set_status(Status(StatusCode.ERROR, "wrong answer"))
    agent.end(end_time=int(episode.ended_at.timestamp() * 1e9))


def _chat_span(episode: AgentEpisode, call: ModelCall, tools: str) -> tuple[str, dict[str, Any]]:
    """The name and attributes of a model call's span (GenAI ``chat``)."""
    return f"chat {episode.model_version[:12]}", {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "ratchet",
        "gen_ai.request.model": episode.model_version,
        "gen_ai.response.model": episode.model_version,
        "gen_ai.response.id": call.response_id,
        "gen_ai.tool.definitions": tools,
        "gen_ai.input.messages": json.dumps([_semconv_message(m) for m in call.input_messages]),
        "gen_ai.output.messages": json.dumps(
            [{**_semconv_message(call.output), "finish_reason": call.finish_reason}]
        ),
        "gen_ai.usage.input_tokens": call.usage["input_tokens"],
        "gen_ai.usage.output_tokens": call.usage["output_tokens"],
    }


def _tool_span(run: ToolRun) -> tuple[str, dict[str, Any]]:
    """The name and attributes of a tool run's span (GenAI ``execute_tool``)."""
    return f"execute_tool {run.name}", {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": run.name,
        "gen_ai.tool.call.id": run.call_id,
        "gen_ai.tool.call.arguments": json.dumps(run.arguments),
        "gen_ai.tool.call.result": run.result,
    }


def _arguments(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    return {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters") or {},
    }


def _trace_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI wire message as a ``ratchet.trace/v1`` message (arguments as objects)."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call["id"],
                "name": call["function"]["name"],
                "arguments": _arguments(call["function"].get("arguments") or ""),
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _semconv_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI wire message as a GenAI semantic-convention message (role + typed parts)."""
    role = message["role"]
    if role == "tool":
        part = {
            "type": "tool_call_response",
            "id": message.get("tool_call_id"),
            "response": message.get("content"),
        }
        return {"role": "tool", "parts": [part]}
    parts: list[dict[str, Any]] = []
    if message.get("content"):
        parts.append({"type": "text", "content": message["content"]})
    for call in message.get("tool_calls") or []:
        parts.append(
            {
                "type": "tool_call",
                "id": call["id"],
                "name": call["function"]["name"],
                "arguments": _arguments(call["function"].get("arguments") or ""),
            }
        )
    return {"role": role, "parts": parts}

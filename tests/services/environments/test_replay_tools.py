"""Tools the failing trace never called: a replay task's calls nobody recorded go to a live
endpoint on the deployment's terms (allow-list, timeout, size cap, rate limit), every live
answer is kept for the next rollout, and what nobody could answer is counted per task.

The MCP endpoint is a real server written with the official SDK (``mcp_tools_server.py``),
started by the tests over stdio and streamable HTTP; it writes down every call that reaches
it, so "never called" is the server's word. The HTTP endpoint is a real HTTP server.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.environments.base import TaskSpec
from services.environments.replay import ReplayEnvironment
from services.environments.replay.endpoints import EndpointConfigError, from_job_env
from services.environments.replay.mcp_client import McpTransport
from services.environments.replay.records import (
    RecordedCall,
    canonical_arguments,
    schema_hash,
    write_store_file,
)
from services.environments.replay.sandbox import TOOL_ANSWERS_FILE
from services.environments.replay.tool_config import ToolEndpointConfig
from services.environments.replay.tool_endpoints import LiveToolEndpoint, Pacer, no_record
from tests.services.environments.mcp_support import (
    ENDPOINT,
    airport_trace,
    calls_made,
    config,
    http_server,
    stdio_command,
)
from tests.services.environments.replay_traces import hermes

GATE = {"gate": "D4"}


@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "calls.jsonl"


@pytest.fixture(scope="module")
def stdio(calls: Path) -> Iterator[McpTransport]:
    """One stdio server for the module's tests (each test builds its own endpoint terms
    over it): starting an interpreter per test would cost more than the tests."""
    transport = McpTransport(config(command=stdio_command(calls)))
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def streamable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    calls = tmp_path_factory.mktemp("mcp-http") / "calls.jsonl"
    with http_server(calls) as url:
        yield url, calls


def endpoint(transport: McpTransport, **terms: Any) -> LiveToolEndpoint:
    return LiveToolEndpoint(config(command=["shared"], **terms), transport=lambda _: transport)


def desk_task(env: ReplayEnvironment, external_id: str = "gate-1") -> TaskSpec:
    task = env.task_from_trace(airport_trace(external_id))
    assert isinstance(task, TaskSpec), task
    return task


def ask(env: ReplayEnvironment, task: TaskSpec, *completions: str) -> list[str]:
    """One chat episode of ``completions``, verified; the tool messages it got."""
    episode = env.chat_start(task, max_turns=len(completions) + 1)
    for completion in completions:
        env.chat_step(task, episode, completion)
    env.chat_verify(task, episode)
    return [str(m.content) for m in episode.messages if m.role == "tool"]


# -- MCP: the call nobody recorded ------------------------------------------------------


def test_a_call_nobody_recorded_goes_to_the_mcp_server_over_stdio(
    stdio: McpTransport, calls: Path
) -> None:
    env = ReplayEnvironment(live_tools={ENDPOINT: endpoint(stdio)})
    task = desk_task(env)
    before = len(calls_made(calls))
    replies = ask(
        env,
        task,
        hermes("flight_status", {"flight": "LX318"}),  # recorded by the trace: replayed
        hermes("gate_walk_minutes", GATE),  # the call the trace never made
        "LX318 leaves 14:05 from D4, an 11 minute walk.",
    )
    assert replies == ["LX318 departs 14:05 from gate D4", "D4: an 11 minute walk"]
    assert calls_made(calls)[before:] == [{"tool": "gate_walk_minutes", "arguments": GATE}]


def test_a_call_nobody_recorded_goes_to_the_mcp_server_over_streamable_http(
    streamable: tuple[str, Path],
) -> None:
    url, calls = streamable
    live = LiveToolEndpoint(config(url=url))
    env = ReplayEnvironment(live_tools={ENDPOINT: live})
    try:
        assert ask(env, desk_task(env), hermes("gate_walk_minutes", GATE), "11") == [
            "D4: an 11 minute walk"
        ]
        tools = {tool.name: tool for tool in live.list_tools() or []}
    finally:
        env.close()
    assert calls_made(calls) == [{"tool": "gate_walk_minutes", "arguments": GATE}]
    # The server's readOnlyHint is read back to be shown, not obeyed: rebook says it is not
    # read-only, and it is the allow-list, not the hint, that keeps it from being called.
    assert tools["gate_walk_minutes"].read_only_hint is True
    assert tools["rebook"].read_only_hint is False


@pytest.mark.parametrize("transport", ["stdio", "streamable_http"])
def test_a_tool_off_the_allow_list_is_never_called(
    transport: str, stdio: McpTransport, calls: Path, streamable: tuple[str, Path]
) -> None:
    if transport == "stdio":
        live, seen = endpoint(stdio), calls
    else:
        live, seen = LiveToolEndpoint(config(url=streamable[0])), streamable[1]
    env = ReplayEnvironment(live_tools={ENDPOINT: live})
    before = len(calls_made(seen))
    task = desk_task(env)
    try:
        replies = ask(env, task, hermes("rebook", {"flight": "LX318"}), "Rebooked.")
    finally:
        live.close() if transport != "stdio" else None
    assert replies == [no_record("rebook")]
    assert calls_made(seen)[before:] == []  # the server's own count: it never got the call
    assert live.usage.refused == 1 and live.usage.calls == 0
    assert env.job_outputs(Path("/nonexistent"))["unanswerable_calls"][task.task_id] == {
        "calls": 1,
        "episodes": 1,
        "episodes_unanswered": 1,
    }


def test_a_tool_that_outlasts_its_timeout_gives_no_result(stdio: McpTransport) -> None:
    live = endpoint(stdio, tools=("slow_lookup",), timeout_s=1.0)
    env = ReplayEnvironment(live_tools={ENDPOINT: live})
    task = desk_task(env)
    replies = ask(env, task, hermes("slow_lookup", {"seconds": 6}), "?")
    assert replies == ["error: tool slow_lookup gave no result: timed out after 1 s"]
    assert live.usage.failed == 1
    # A timeout is not an answer: nothing recorded, and the call counts as unanswerable.
    outputs = env.job_outputs(Path("/nonexistent"))
    assert "tool_answers" not in outputs
    assert outputs["unanswerable_calls"][task.task_id]["calls"] == 1
    # The session survives a cancelled call.
    assert live.answer("slow_lookup", {"seconds": 0}).text == "slow answer"


def test_a_result_over_the_size_cap_becomes_an_error_text(stdio: McpTransport) -> None:
    live = endpoint(stdio, tools=("baggage_manifest",), max_result_bytes=1000)
    assert live.answer("baggage_manifest", {"size": 1000}).recordable
    answer = live.answer("baggage_manifest", {"size": 1001})
    assert answer.text == (
        "error: tool baggage_manifest answered more than this endpoint's cap of 1000 bytes; "
        "no result"
    )
    assert not answer.answered and not answer.recordable


def test_the_tools_own_error_is_shown_but_not_kept(stdio: McpTransport) -> None:
    env = ReplayEnvironment(live_tools={ENDPOINT: endpoint(stdio, tools=("broken",))})
    task = desk_task(env)
    (reply,) = ask(env, task, hermes("broken", {"code": "Z"}), "?")
    assert reply.startswith("error: ")
    outputs = env.job_outputs(Path("/nonexistent"))
    assert "tool_answers" not in outputs  # an error may be transient: asked again next time
    assert outputs["unanswerable_calls"] == {}  # but the tool did answer


def test_a_stdio_server_never_sees_the_jobs_variables(
    stdio: McpTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_JUDGE_ENDPOINTS", '{"grader": {"api_key": "secret"}}')
    live = endpoint(stdio, tools=("has_variable",))
    assert live.answer("has_variable", {"name": "PATH"}).text == "yes"
    # The server was started before the variable was set in this test process; a fresh
    # server started now proves the same of a job's own variables.
    fresh = LiveToolEndpoint(
        config(command=stdio_command(Path(stdio.config.command[-1])), tools=("has_variable",))
    )
    try:
        assert fresh.answer("has_variable", {"name": "RATCHET_JUDGE_ENDPOINTS"}).text == "no"
    finally:
        fresh.close()


# -- every live answer is kept -----------------------------------------------------------


def test_live_answers_are_listed_in_the_jobs_output_and_replayed_next_time(
    stdio: McpTransport, calls: Path, tmp_path: Path
) -> None:
    env = ReplayEnvironment(live_tools={ENDPOINT: endpoint(stdio)})
    task = desk_task(env)
    before = len(calls_made(calls))
    for _ in range(3):  # a GRPO group asks the same call: the server is asked once
        assert ask(env, task, hermes("gate_walk_minutes", {"gate": "B12"}), "ok") == [
            "B12: an 11 minute walk"
        ]
    assert len(calls_made(calls)) == before + 1

    outputs = env.job_outputs(tmp_path)
    listing = outputs["tool_answers"]
    data = (tmp_path / TOOL_ANSWERS_FILE).read_bytes()
    assert listing == {
        "file": TOOL_ANSWERS_FILE,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "count": 1,
    }
    gate_tool = next(t for t in task.tools if t["name"] == "gate_walk_minutes")
    recorded = RecordedCall.from_dict(json.loads(data))
    # Kept under the call the agent made: the task's schema of the tool, its arguments.
    assert recorded == RecordedCall(
        "gate_walk_minutes",
        schema_hash(gate_tool),
        canonical_arguments({"gate": "B12"}),
        "B12: an 11 minute walk",
    )
    assert outputs["tool_endpoints"][ENDPOINT] == {
        "calls": 1,
        "answered": 1,
        "refused": 0,
        "failed": 0,
    }

    # The next rollout (another process, the store shipped with its dataset) replays it.
    store = tmp_path / "tool_responses.jsonl"
    write_store_file(store, [recorded])
    shipped = TaskSpec.from_json(
        {**task.to_dict(), "metadata": {**task.metadata, "ratchet": {"tool_store": str(store)}}}
    )
    later = ReplayEnvironment(live_tools={ENDPOINT: endpoint(stdio)})
    assert ask(later, shipped, hermes("gate_walk_minutes", {"gate": "B12"}), "ok") == [
        "B12: an 11 minute walk"
    ]
    assert len(calls_made(calls)) == before + 1  # not called again
    assert "tool_answers" not in later.job_outputs(tmp_path / "later")


# -- unanswerable calls, counted per task ------------------------------------------------


def test_unanswerable_calls_are_counted_per_task_and_episode(tmp_path: Path) -> None:
    env = ReplayEnvironment()  # no endpoint: a call nobody recorded has no answer
    trace = airport_trace("count-1", endpoint=None)
    task = env.task_from_trace(trace)
    other = env.task_from_trace(airport_trace("count-2", endpoint=None))
    assert isinstance(task, TaskSpec) and isinstance(other, TaskSpec)
    gate = hermes("gate_walk_minutes", GATE)
    assert ask(env, task, gate, gate, "?") == [no_record("gate_walk_minutes")] * 2
    assert ask(env, task, hermes("flight_status", {"flight": "LX318"}), "ok")  # recorded
    assert ask(env, other, gate, "?") == [no_record("gate_walk_minutes")]
    # A text (tiny-family) episode counts the same way.
    script = iter([gate, "no idea"])
    env.verify(other, env.run_episode(other, lambda _: next(script), max_turns=3))
    assert env.job_outputs(tmp_path)["unanswerable_calls"] == {
        task.task_id: {"calls": 2, "episodes": 2, "episodes_unanswered": 1},
        other.task_id: {"calls": 2, "episodes": 2, "episodes_unanswered": 2},
    }


# -- the HTTP endpoint's terms -----------------------------------------------------------


class _Tools(http.server.BaseHTTPRequestHandler):
    """``/call``: answers ``{"content": "<tool> ok"}`` (``/big``: 5000 bytes; ``/moved``: a
    302 to the other server); records each request's path and Authorization header."""

    seen: list[tuple[str, str | None]] = []
    other = ""

    def _record(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))

    def do_POST(self) -> None:
        self._record()
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", f"{type(self).other}/landed")
            self.end_headers()
            return
        reply = "x" * 5000 if self.path == "/big" else json.dumps({"content": f"{body['name']} ok"})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(reply.encode())

    def do_GET(self) -> None:  # where a redirected POST lands (urllib makes it a GET)
        self._record()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"landed")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def tool_servers() -> Iterator[tuple[str, str]]:
    """Two servers: one on 127.0.0.1, the other named ``localhost`` (another host)."""
    _Tools.seen = []
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Tools) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    first = f"http://127.0.0.1:{servers[0].server_address[1]}"
    second = f"http://localhost:{servers[1].server_address[1]}"
    _Tools.other = second
    yield first, second
    for server in servers:
        server.shutdown()
        server.server_close()


def http_endpoint(url: str, **terms: Any) -> LiveToolEndpoint:
    return LiveToolEndpoint(
        ToolEndpointConfig(
            name="orders",
            kind="http",
            url=url,
            tools=frozenset({"order_status"}),
            api_key="orders-key",
            **{"timeout_s": 5.0, **terms},
        )
    )


def test_the_http_endpoint_keeps_the_same_terms(tool_servers: tuple[str, str]) -> None:
    first, _ = tool_servers
    live = http_endpoint(f"{first}/call")
    assert live.answer("order_status", {"id": 1}).text == "order_status ok"
    assert live.answer("cancel_order", {"id": 1}).text == no_record("cancel_order")
    assert _Tools.seen == [("/call", "Bearer orders-key")]  # cancel_order never sent
    big = http_endpoint(f"{first}/big", max_result_bytes=4096).answer("order_status", {})
    assert big.text == (
        "error: tool order_status answered more than this endpoint's cap of 4096 bytes; no result"
    )
    assert not big.answered


def test_the_http_client_never_carries_the_key_to_another_host(
    tool_servers: tuple[str, str],
) -> None:
    first, _ = tool_servers
    answer = http_endpoint(f"{first}/moved").answer("order_status", {"id": 1})
    assert answer.text == "landed"
    assert _Tools.seen == [("/moved", "Bearer orders-key"), ("/landed", None)]


def test_calls_are_paced_per_endpoint_and_refused_past_their_timeout() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(30, clock=lambda: now[0], sleep=sleep)  # one call every 2 s
    assert pacer.acquire(5) and pacer.acquire(5) and pacer.acquire(5)
    assert slept == [2.0, 2.0]
    # Callers at one instant (a clock that does not move): each waits 2 s more than the
    # last, and one whose wait would pass its timeout is refused without taking a turn.
    waits: list[float] = []
    crowd = Pacer(30, clock=lambda: 0.0, sleep=waits.append)
    assert crowd.acquire(3) and crowd.acquire(3)
    assert not crowd.acquire(3)  # would wait 4 s
    assert crowd.acquire(5)  # takes the 4 s turn the refused caller left
    assert waits == [2.0, 4.0]


def test_a_rate_limited_call_is_refused_not_queued_forever(tool_servers: tuple[str, str]) -> None:
    first, _ = tool_servers
    live = http_endpoint(f"{first}/call", requests_per_minute=1, timeout_s=0.5)
    assert live.answer("order_status", {"id": 1}).answered
    refused = live.answer("order_status", {"id": 2})
    assert (
        refused.text == "error: tool order_status is rate-limited (1 calls per minute); no result"
    )
    assert not refused.answered and live.usage.failed == 1
    assert [path for path, _ in _Tools.seen] == ["/call"]


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ({"url": "http://t"}, "tools must list the tool names"),
        ({"url": "http://t", "tools": "gate"}, "tools must list the tool names"),
        ({"kind": "mcp", "tools": ["a"]}, "an mcp endpoint a url or a command"),
        ({"kind": "mcp", "command": [], "tools": ["a"]}, "command must be a non-empty argv"),
        ({"kind": "smtp", "url": "http://t", "tools": ["a"]}, "kind must be one of"),
        ({"url": "file:///etc/passwd", "tools": ["a"]}, "url must be an http"),
        ({"url": "http://t", "tools": ["a"], "timeout_s": "soon"}, "timeout_s must be a number"),
        ({"url": "http://t", "tools": ["a"], "requests_per_minute": -1}, "requests_per_minute"),
        ({"url": "http://t", "tools": ["a"], "max_result_bytes": True}, "max_result_bytes"),
        ({"url": "http://t", "tools": ["a"], "api_key": 7}, "api_key must be a string"),
        ({"url": "http://t", "tools": ["a"], "headers": {}}, "unknown field(s) ['headers']"),
    ],
)
def test_a_job_refuses_a_tool_endpoint_variable_naming_the_field(
    endpoint: dict[str, Any], message: str
) -> None:
    with pytest.raises(EndpointConfigError) as refused:
        from_job_env({"RATCHET_TOOL_ENDPOINTS": json.dumps({"orders": endpoint})})
    assert "tool endpoint 'orders'" in str(refused.value) and message in str(refused.value)


def test_a_server_that_cannot_start_is_an_unanswerable_call_failing_fast(tmp_path: Path) -> None:
    live = LiveToolEndpoint(config(command=[str(tmp_path / "no-such-server")]))
    first = live.answer("gate_walk_minutes", GATE)
    assert first.text.startswith("error: tool gate_walk_minutes gave no result: cannot connect")
    assert not first.answered
    # The next call does not wait out another start: it fails at once, saying the same.
    again = live.answer("flight_status", {"flight": "LX318"})
    assert again.text.endswith(first.text.split("gave no result: ")[1])
    assert live.usage.failed == 2
    live.close()

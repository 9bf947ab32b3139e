"""``ratchet loop tools`` and set-aside tasks in ``ratchet tasks``, through a real api whose
deployment lists a real MCP server (the SDK's, over stdio) as a replay loop's endpoint."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.models import Task
from services.db.queries.task_set_aside import UNANSWERABLE_CALLS, set_aside_tasks
from services.db.session import SessionFactory
from services.settings import Settings, ToolEndpoint, get_settings
from tests.services.api.support import ADMIN_TOKEN, serve
from tests.services.cli.support import run
from tests.services.curation.support import make_loop
from tests.services.environments.mcp_support import ENDPOINT, stdio_command


@pytest.fixture
def desk_api(
    database_url: str,
    engine: Engine,
    session_factory: SessionFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[str]:
    endpoints = {
        ENDPOINT: ToolEndpoint(
            kind="mcp",
            command=stdio_command(tmp_path / "calls.jsonl"),
            tools=["gate_walk_minutes", "flight_status", "not_served"],
        )
    }
    settings = Settings(
        database_url=database_url, admin_token=ADMIN_TOKEN, tool_endpoints=endpoints
    )
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        monkeypatch.setenv("RATCHET_PUBLIC_URL", url)
        monkeypatch.setenv("RATCHET_ADMIN_TOKEN", ADMIN_TOKEN)
        get_settings.cache_clear()
        yield url
    get_settings.cache_clear()


def test_loop_tools_shows_the_allow_list_beside_the_servers_hints(
    desk_api: str, session_factory: SessionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    make_loop(
        session_factory,
        "desk-loop",
        environment="replay",
        curation_policy={"tool_endpoint": ENDPOINT},
    )
    code, out, err = run(capsys, "loop", "tools", "desk-loop", "--json")
    assert code == 0, err
    found = json.loads(out)
    assert (found["endpoint"], found["kind"], found["error"]) == (ENDPOINT, "mcp", None)
    tools = {tool["name"]: tool for tool in found["tools"]}
    assert tools["gate_walk_minutes"] | {"description": None} == {
        "name": "gate_walk_minutes",
        "allowed": True,
        "listed": True,
        "read_only_hint": True,
        "description": None,
    }
    # The server says rebook is not read-only; it is off the allow-list either way.
    assert (tools["rebook"]["allowed"], tools["rebook"]["read_only_hint"]) == (False, False)
    # A read-only hint of a tool the operator did not allow-list grants nothing.
    assert (tools["slow_lookup"]["allowed"], tools["slow_lookup"]["read_only_hint"]) == (
        False,
        True,
    )
    # Allow-listed but not served: the operator sees the mismatch.
    assert (tools["not_served"]["allowed"], tools["not_served"]["listed"]) == (True, False)

    code, table, _ = run(capsys, "loop", "tools", "desk-loop")
    assert code == 0 and "tool endpoint desk (mcp)" in table
    assert "never permission" in table

    make_loop(session_factory, "plain-loop", environment="replay")
    code, out, _ = run(capsys, "loop", "tools", "plain-loop")
    assert code == 0 and "names no tool endpoint" in out


def test_a_set_aside_task_is_listed_shown_and_restored(
    desk_api: str, session_factory: SessionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    loop_id = make_loop(session_factory, "aside-loop", environment="replay")
    other_loop = make_loop(session_factory, "other-loop", environment="replay")
    with session_factory.begin() as session:
        rows = [
            Task(
                loop_id=loop_id if n < 2 else other_loop,
                content_hash=f"h{n}",
                environment="replay",
                spec={"prompt": f"task {n}"},
                cluster_id=f"c{n}",
                split="train",
            )
            for n in range(3)
        ]
        session.add_all(rows)
        session.flush()
        ids = [row.id for row in rows]
        set_aside_tasks(
            session=session,
            loop_id=loop_id,
            task_ids=[ids[0]],
            reason=UNANSWERABLE_CALLS,
            detail="every one of its 2 episode(s) in run r needed a tool result nobody could give",
            at=dt.datetime.now(dt.UTC),
        )
    code, out, _ = run(capsys, "tasks", "list", "aside-loop", "--set-aside", "--json")
    (aside,) = json.loads(out)["tasks"]
    assert aside["id"] == ids[0] and aside["set_aside_reason"] == UNANSWERABLE_CALLS
    code, table, _ = run(capsys, "tasks", "list", "aside-loop")
    assert "train aside" in table
    code, shown, _ = run(capsys, "tasks", "show", str(ids[0]))
    assert "unanswerable_calls" in shown and "nobody could give" in shown
    assert f"ratchet tasks restore --loop aside-loop {ids[0]}" in shown

    code, _, err = run(capsys, "tasks", "restore", "--loop", "aside-loop", str(ids[0]), str(ids[2]))
    assert code == 1 and "nothing was restored" in err and "task_ids.1" in err
    code, out, _ = run(capsys, "tasks", "restore", "--loop", "aside-loop", str(ids[0]), str(ids[1]))
    assert code == 0 and out.startswith("restored 1 set-aside task(s) of aside-loop")
    code, out, _ = run(capsys, "tasks", "list", "aside-loop", "--set-aside", "--json")
    assert json.loads(out)["tasks"] == []

"""examples/support-agent: its episodes arrive as valid traces with the tools, the tool
calls and their results, and its feedback lands on the traces it names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy import Engine, select

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.models import Trace, TraceFeedback
from services.db.session import SessionFactory
from services.environments.registry import environment_names
from services.settings import Settings
from tests.services.api.support import ADMIN_TOKEN, create_loop, curate_once, serve

REPO = Path(__file__).resolve().parents[2]
# The example is written for the replay environment; until it is installed its loop is a
# toolcalc loop and only the posting is checked.
ENVIRONMENT = "replay" if "replay" in environment_names() else "toolcalc"
AGENT = REPO / "examples" / "support-agent" / "agent.py"


def test_the_example_agent_posts_traces_and_feedback(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> None:
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        with httpx.Client(base_url=url) as http:
            loop = create_loop(http, "bookshop", environment=ENVIRONMENT)
        secret = str(loop["signing_secret"])
        env = {"PYTHONPATH": str(REPO / "clients" / "python" / "src"), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(
            [sys.executable, str(AGENT), "--api", url, "--loop", "bookshop", "--secret", secret],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    with session_factory() as session:
        traces = list(session.scalars(select(Trace).order_by(Trace.id)))
        feedback = list(session.scalars(select(TraceFeedback).order_by(TraceFeedback.id)))
    assert [t.body["metadata"]["ticket"] for t in traces] == ["t-1", "t-2", "t-3"]
    assert [t.success for t in traces] == [True, True, False]
    refund = traces[2].body
    assert {tool["name"] for tool in refund["tools"]} == {
        "find_order",
        "track_parcel",
        "refund_order",
    }
    calls = [c for m in refund["messages"] for c in m.get("tool_calls") or ()]
    assert [c["name"] for c in calls] == ["find_order", "track_parcel"]
    assert calls[0]["arguments"] == {"order_id": "PT-1003"}
    results = [m for m in refund["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [c["id"] for c in calls]
    assert '"lost"' in results[1]["content"]
    assert refund["reference_answer"].startswith("Order PT-1003 was lost")
    assert [(f.trace_id, f.score, f.label) for f in feedback] == [
        (traces[0].id, 1.0, "resolved"),
        (traces[1].id, 1.0, "resolved"),
        (traces[2].id, 0.0, "unresolved"),
    ]
    assert feedback[2].correction == refund["reference_answer"]
    if ENVIRONMENT == "replay":
        curate_once(session_factory, "bookshop")
        with session_factory() as session:
            refund_trace = session.get_one(Trace, traces[2].id)
            assert refund_trace.curation_outcome == "task", refund_trace.curation_detail

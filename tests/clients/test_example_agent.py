"""examples/support-agent: its README's commands work as written against a real api and
Postgres on a port of their own; its episodes arrive as valid traces with the tools, the
tool calls and their results, and its feedback lands on the traces it names; with no api
there, it ends in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.models import Trace, TraceFeedback
from services.db.session import SessionFactory
from services.settings import Settings
from tests.services.api.support import ADMIN_TOKEN, create_loop, curate_once, free_port, serve

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "support-agent"
AGENT = EXAMPLE / "agent.py"
USAGE = "error: track_parcel is missing required argument(s) carrier"


@pytest.fixture
def api_url(database_url: str, engine: Engine, session_factory: SessionFactory) -> Iterator[str]:
    """Ratchet's api (real uvicorn, real Postgres) on a random port, not 8000."""
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        yield url


def _clean_environment() -> dict[str, str]:
    """This process's environment without Ratchet's settings or a PYTHONPATH."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("RATCHET_") and key != "PYTHONPATH"
    }


def _run_agent(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {**_clean_environment(), "PYTHONPATH": str(REPO / "clients" / "python" / "src")}
    return subprocess.run(
        [sys.executable, str(AGENT), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def readme_blocks() -> list[str]:
    """The README's ``bash`` blocks, each as the text a user pastes into a shell."""
    text = (EXAMPLE / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.slow
def test_the_readme_runs_as_written(
    api_url: str, session_factory: SessionFactory, tmp_path: Path
) -> None:
    """A user's shell: a fresh virtualenv (the agent's), Ratchet's `ratchet` command, the
    api on a port of its own named by RATCHET_PUBLIC_URL, the checkout's files; every
    ``bash`` block of the README run as it is."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copytree(REPO / "clients", checkout / "clients")  # pip builds in the tree
    (checkout / "examples").symlink_to(REPO / "examples")
    env = {
        **_clean_environment(),
        "HOME": str(tmp_path),  # no ~/.ratchet of the developer's
        "PATH": os.pathsep.join(
            [str(venv / "bin"), str(Path(sys.executable).parent), "/usr/bin:/bin"]
        ),
        "PYTHONPATH": str(REPO),  # `ratchet` runs this checkout
        "RATCHET_PUBLIC_URL": api_url,
        "RATCHET_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    blocks = readme_blocks()
    assert len(blocks) == 2
    outputs = []
    for block in blocks:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{block}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)

    secret_file = checkout / "bookshop.json"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    with session_factory() as session:
        traces = list(session.scalars(select(Trace).order_by(Trace.id)))
        feedback = list(session.scalars(select(TraceFeedback)))
    assert len(traces) == 6 and len(feedback) == 6
    assert {t.body["metadata"]["shop"] for t in traces} == {"pageturner"}
    for trace in traces:  # `ratchet traces list` shows every one
        assert trace.external_id in outputs[0]
    written = (checkout / "bookshop-traffic" / "traces.jsonl").read_text().splitlines()
    assert len(written) == 1000


def test_the_example_agent_posts_traces_and_feedback(
    api_url: str, session_factory: SessionFactory
) -> None:
    """After the tool change: the stand-in calls track_parcel the old way, gets the usage
    error, and fails; the traces carry the v2 tools, the calls and their results."""
    with httpx.Client(base_url=api_url) as http:
        loop = create_loop(http, "bookshop", environment="replay")
    done = _run_agent(
        "--tickets", "12", "--tools-version", "v2", "--secret", str(loop["signing_secret"]),
        env={"RATCHET_PUBLIC_URL": api_url},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with session_factory() as session:
        traces = list(session.scalars(select(Trace).order_by(Trace.id)))
        feedback = {f.trace_id: f for f in session.scalars(select(TraceFeedback))}
    assert len(traces) == 12 and len(feedback) == 12
    for trace in traces:
        body = trace.body
        assert [t["name"] for t in body["tools"]] == [
            "find_order",
            "track_parcel",
            "refund_order",
            "check_stock",
        ]
        assert body["tools"][1]["parameters"]["required"] == ["tracking_id", "carrier"]
        calls = [c for m in body["messages"] for c in m.get("tool_calls") or ()]
        results = [m for m in body["messages"] if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in results] == [c["id"] for c in calls]
        tracked = body["metadata"]["ticket"] in ("status", "refund_lost", "refund_damaged")
        if tracked:  # the stand-in tracks every order it is asked about but a total's
            assert results[1]["content"] == USAGE and trace.success is False
        rating = feedback[trace.id]
        assert rating.score == (1.0 if trace.success else 0.0)
        assert rating.correction == (None if trace.success else body["reference_answer"])
    assert {t.body["metadata"]["ticket"] for t in traces if t.success} <= {"total", "stock"}
    curate_once(session_factory, "bookshop")
    with session_factory() as session:
        outcomes = {t.curation_outcome for t in session.scalars(select(Trace))}
    assert "task" in outcomes


def test_with_no_api_there_the_agent_says_so_in_one_line(tmp_path: Path) -> None:
    nothing = f"http://127.0.0.1:{free_port()}"
    secret_file = tmp_path / "bookshop.json"
    secret_file.write_text(json.dumps({"loop": "bookshop", "signing_secret": "whsec_" + "A" * 32}))
    done = _run_agent("--secret-file", str(secret_file), env={"RATCHET_PUBLIC_URL": nothing})
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"cannot reach Ratchet's api at {nothing}" in done.stderr
    assert "RATCHET_PUBLIC_URL" in done.stderr


def test_bad_credentials_end_in_one_line(api_url: str, tmp_path: Path) -> None:
    missing = _run_agent(env={"RATCHET_PUBLIC_URL": api_url})
    assert missing.returncode == 2 and "no signing secret" in missing.stderr
    unreadable = _run_agent("--secret-file", str(tmp_path / "absent.json"))
    assert unreadable.returncode == 2 and "cannot read the secret file" in unreadable.stderr
    with httpx.Client(base_url=api_url) as http:
        create_loop(http, "bookshop", environment="replay")
    wrong = _run_agent(
        "--loop", "bookshop", "--secret", "whsec_" + "B" * 32, env={"RATCHET_PUBLIC_URL": api_url}
    )
    assert wrong.returncode == 1, wrong.stderr
    assert wrong.stderr.count("\n") == 1 and "Traceback" not in wrong.stderr
    assert "401" in wrong.stderr

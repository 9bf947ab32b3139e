"""The light client (clients/python): installs without torch, signs as the api verifies,
batches, retries honouring Retry-After, sync and async, against a real api."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, func, select

from services.api.app import create_app
from services.api.state import AppState, TemporalConnection
from services.db.models import Trace, TraceFeedback
from services.db.session import SessionFactory
from services.ingest.signature import sign as server_sign
from services.settings import Settings
from tests.services.api.support import ADMIN_TOKEN, create_loop, make_trace, serve

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "python"
sys.path.insert(0, str(CLIENT_DIR / "src"))

from ratchet_client import (  # noqa: E402
    AsyncTraceClient,
    RatchetError,
    RatchetUnreachable,
    TraceClient,
    sign,
)

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture
def api(
    database_url: str, engine: Engine, session_factory: SessionFactory
) -> Iterator[tuple[str, dict[str, object]]]:
    """A real api (uvicorn) over a fresh database, with one loop."""
    settings = Settings(database_url=database_url, admin_token=ADMIN_TOKEN, ingest_max_batch=4)
    state = AppState(settings, engine, session_factory, TemporalConnection(settings))
    with serve(create_app(settings, state=state)) as url:
        with httpx.Client(base_url=url) as http:
            loop = create_loop(http, "client-test")
        yield url, loop


def stored(session_factory: SessionFactory) -> int:
    with session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(Trace)) or 0)


def test_the_signature_is_the_one_the_api_verifies() -> None:
    body = b'{"traces":[]}'
    assert sign(SECRET, "msg_1", 1_700_000_000, body) == server_sign(
        SECRET, "msg_1", 1_700_000_000, body
    )
    with pytest.raises(ValueError, match="whsec_"):
        TraceClient("http://x", "loop", "whsec_not base64!")


def test_batches_buffering_and_errors_against_the_api(
    api: tuple[str, dict[str, object]], session_factory: SessionFactory
) -> None:
    url, loop = api
    secret = str(loop["signing_secret"])
    traces = [make_trace(f"t{i}") for i in range(10)]
    with TraceClient(url, "client-test", secret, batch_size=4) as client:
        result = client.post(traces)
        assert (result.accepted, result.duplicates, result.rejected) == (10, 0, 0)
        assert [r["index"] for r in result.results] == list(range(10))
        again = client.post(traces[:3])  # a re-post is a no-op, never a second row
        assert (again.accepted, again.duplicates) == (0, 3)
        for trace in [make_trace(f"b{i}") for i in range(5)]:
            client.add(trace)  # the 4th add sends a batch, the 5th waits for the flush
        assert stored(session_factory) == 14
    assert stored(session_factory) == 15  # leaving the block flushed

    bad = make_trace("bad")
    del bad["messages"]
    with TraceClient(url, "client-test", secret) as client:
        partial = client.post([bad, make_trace("good")])
    assert (partial.accepted, partial.rejected) == (1, 1)
    assert partial.results[0]["fields"][0]["path"].endswith("messages")

    with (
        TraceClient(url, "client-test", SECRET) as client,
        pytest.raises(RatchetError) as refused,
    ):
        client.post([make_trace("x")])
    assert refused.value.status_code == 401
    with (
        TraceClient(url, "no-such-loop", secret) as client,
        pytest.raises(RatchetError) as missing,
    ):
        client.post([make_trace("y")])
    assert missing.value.status_code in (401, 404)


def test_feedback_after_the_fact(
    api: tuple[str, dict[str, object]], session_factory: SessionFactory
) -> None:
    """Feedback goes to the trace it names (buffered traces are sent first), a repeat is a
    no-op, an unknown trace is a RatchetError 404, and feedback that says nothing never
    leaves the client."""
    url, loop = api
    secret = str(loop["signing_secret"])
    with TraceClient(url, "client-test", secret) as client:
        client.add(make_trace("ticket/7"))  # a slash in the id is path-quoted
        first = client.feedback("ticket/7", score=0.0, label="wrong", correction="42")
        assert (first.external_id, first.status) == ("ticket/7", "accepted")
        again = client.feedback("ticket/7", score=0.0, label="wrong", correction="42")
        assert (again.id, again.status) == (first.id, "duplicate")
        with pytest.raises(RatchetError) as unknown:
            client.feedback("never-posted", score=1.0)
        assert (unknown.value.status_code, unknown.value.code) == (404, "trace_not_found")
        with pytest.raises(ValueError, match="at least one"):
            client.feedback("ticket/7", comment="only a comment")
    with session_factory() as session:
        assert session.scalar(select(func.count()).select_from(TraceFeedback)) == 1


def test_retries_honour_retry_after_and_keep_the_webhook_id() -> None:
    seen: list[tuple[float, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((time.monotonic(), request.headers["webhook-id"]))
        if len(seen) < 3:
            return httpx.Response(503, headers={"Retry-After": "1"}, json={"error": {}})
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0, "rejected": 0})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    client = TraceClient("http://api", "loop", SECRET, http=http, backoff_s=0.01)
    assert client.post([make_trace("r")]).accepted == 1
    assert len(seen) == 3 and len({msg_id for _, msg_id in seen}) == 1
    assert seen[1][0] - seen[0][0] >= 0.95 and seen[2][0] - seen[1][0] >= 0.95

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    unreachable = TraceClient(
        "http://api",
        "loop",
        SECRET,
        http=httpx.Client(transport=httpx.MockTransport(down)),
        max_retries=2,
        backoff_s=0.01,
    )
    with pytest.raises(RatchetUnreachable):
        unreachable.post([make_trace("u")])

    def bad_request(request: httpx.Request) -> httpx.Response:
        return httpx.Response(413, json={"error": {"code": "too_large", "message": "big"}})

    refusing = TraceClient(
        "http://api", "loop", SECRET, http=httpx.Client(transport=httpx.MockTransport(bad_request))
    )
    with pytest.raises(RatchetError, match="413 too_large"):
        refusing.post([make_trace("big")])  # not retryable: raised at once


async def test_the_async_client_posts_and_retries(
    api: tuple[str, dict[str, object]], session_factory: SessionFactory
) -> None:
    url, loop = api
    secret = str(loop["signing_secret"])
    async with AsyncTraceClient(url, "client-test", secret, batch_size=4) as client:
        result = await client.post([make_trace(f"a{i}") for i in range(6)])
        await client.add(make_trace("a-buffered"))
        said = await client.feedback("a-buffered", label="helpful")  # flushes the trace first
        assert said.status == "accepted"
    assert result.accepted == 6
    assert stored(session_factory) == 7


FRESH_VENV_SCRIPT = """
import asyncio, importlib.util, json, sys
from ratchet_client import AsyncTraceClient, TraceClient
heavy = ("torch", "temporalio", "kubernetes", "services")
missing = [m for m in heavy if importlib.util.find_spec(m)]
url, secret, traces = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with TraceClient(url, "client-test", secret, batch_size=2) as client:
    sync = client.post(traces[:3])
async def post_async():
    async with AsyncTraceClient(url, "client-test", secret) as client:
        return await client.post(traces[3:])
result = asyncio.run(post_async())
print(json.dumps({"unexpected_modules": missing, "sync": sync.accepted, "async": result.accepted}))
"""


@pytest.mark.slow
def test_the_client_installs_and_posts_in_a_fresh_venv_without_torch(
    api: tuple[str, dict[str, object]], session_factory: SessionFactory, tmp_path: Path
) -> None:
    url, loop = api
    # Nothing of this checkout or of the test venv leaks in through the environment.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(CLIENT_DIR)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True, env=env
    ).stdout.lower()
    assert "ratchet-client" in frozen or "ratchet_client" in frozen
    for heavy in ("torch", "temporalio", "kubernetes", "sqlalchemy", "fastapi"):
        assert heavy not in frozen, f"{heavy} was installed with the light client"
    traces = [make_trace(f"venv-{i}") for i in range(5)]
    done = subprocess.run(
        [
            str(python),
            "-c",
            textwrap.dedent(FRESH_VENV_SCRIPT),
            url,
            str(loop["signing_secret"]),
            json.dumps(traces),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,  # not the repository: nothing of Ratchet is importable by accident
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"unexpected_modules": [], "sync": 3, "async": 2}
    assert stored(session_factory) == 5

"""Helpers for api tests: trace documents, Standard Webhooks signing, a real uvicorn server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from services.api.app import create_app
from services.api.state import AppState
from services.db.models import Trace
from services.db.queries.loops import LoopFields
from services.db.session import SessionFactory
from services.ingest.provisioning import provision_loop
from services.ingest.signature import sign
from services.secrets import SecretBox
from tests.support import assert_eventually, free_port

REPO = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "test-admin-token"
# A fixed Fernet key, so the test process and the api processes it starts agree on it.
SECRET_KEY = "dGVzdC1zZWNyZXQta2V5LXJhdGNoZXQtMzItYnl0ZXM="
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def make_trace(external_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A valid ratchet.trace/v1 document (a failed toolcalc-like episode)."""
    trace: dict[str, Any] = {
        "schema": "ratchet.trace/v1",
        "external_id": external_id or f"ep-{uuid.uuid4().hex[:12]}",
        "model_version": "champion-1",
        "started_at": "2026-01-02T03:04:05Z",
        "ended_at": "2026-01-02T03:04:07Z",
        "tools": [
            {
                "name": "add",
                "description": "add two integers",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            }
        ],
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "What is 2+3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}],
            },
            {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "add"},
            {"role": "assistant", "content": "6", "token_ids": [54], "logprobs": [-0.1]},
        ],
        "outcome": {
            "success": False,
            "score": 0.2,
            "error": {"kind": "wrong_answer", "message": "expected 5"},
        },
        "reference_answer": None,
        "metadata": {"env": "toolcalc", "api_version": "v2"},
    }
    trace.update(overrides)
    return trace


def signed_headers(
    secret: str,
    body: bytes,
    *,
    msg_id: str | None = None,
    timestamp: int | None = None,
    content_type: str = "application/json",
) -> dict[str, str]:
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "content-type": content_type,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


def body_of(payload: Any) -> bytes:
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under a real uvicorn on 127.0.0.1 (random port) in a thread; yield its URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def create_loop(
    client: httpx.Client | Any, name: str = "support-agent", **fields: Any
) -> dict[str, Any]:
    response = client.post(
        "/v1/loops", json={"name": name, "environment": "toolcalc", **fields}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


@contextmanager
def serve_with_loop(state: AppState) -> Iterator[tuple[str, dict[str, Any]]]:
    """The api of ``state`` under uvicorn with one loop created through the admin API, as
    the ingest tests need it: (url, the created loop with its secrets)."""
    with serve(create_app(state.settings, state=state)) as url:
        with httpx.Client(base_url=url) as http:
            loop = create_loop(http)
        yield url, loop


def provision_toolcalc_loop(session_factory: SessionFactory, name: str) -> tuple[int, str]:
    """A toolcalc loop written straight to Postgres, for tests that start the api as a process
    afterwards: its id and its signing secret."""
    with session_factory.begin() as session:
        created = provision_loop(
            session,
            fields=LoopFields(name=name, environment="toolcalc"),
            box=SecretBox.from_keys(SECRET_KEY),
        )
        return created.loop.id, created.signing_secret


@contextmanager
def api_process(
    database_url: str, port: int, *, workers: int = 1
) -> Iterator[subprocess.Popen[bytes]]:
    """`ratchet api` as a real process on 127.0.0.1:port; stopped with SIGTERM if still up."""
    env = {
        **os.environ,
        "RATCHET_DATABASE_URL": database_url,
        "RATCHET_API_HOST": "127.0.0.1",
        "RATCHET_API_PORT": str(port),
        "RATCHET_API_WORKERS": str(workers),
        "RATCHET_ADMIN_TOKEN": ADMIN_TOKEN,
        "RATCHET_SECRET_KEY": SECRET_KEY,
        "RATCHET_LOG_LEVEL": "WARNING",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "services", "api"], cwd=REPO, env=env, stdin=subprocess.DEVNULL
    )
    try:

        def healthy() -> None:
            assert process.poll() is None, f"the api exited with {process.returncode}"
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError as exc:
                raise AssertionError(str(exc)) from exc

        assert_eventually(healthy, timeout=60, interval=0.2)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()  # the supervisor of several workers stops them too
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait(timeout=30)


def existing_external_ids(
    *, session: Session, loop_id: int, external_ids: Sequence[str]
) -> set[str]:
    """Which of ``external_ids`` are stored for the loop."""
    if not external_ids:
        return set()
    found = session.scalars(
        select(Trace.external_id).where(
            tuple_(Trace.loop_id, Trace.external_id).in_([(loop_id, e) for e in external_ids])
        )
    )
    return set(found)


def curate_once(session_factory: SessionFactory, name: str, *, limit: int = 100) -> None:
    """One curation pass over the loop called ``name``, as the worker's curate_batch activity
    runs it (same pipeline, policy and environment), for tests that serve the api alone."""
    from services.curation import pipeline
    from services.curation.adapters import default_resolver
    from services.curation.policy import CurationPolicy
    from services.db.queries.loops import require_loop

    with session_factory.begin() as session:
        loop = require_loop(session=session, name=name)
        pipeline.curate_batch(
            session,
            loop=loop,
            policy=CurationPolicy.from_json(loop.curation_policy),
            adapter=default_resolver(loop.environment),
            limit=limit,
        )

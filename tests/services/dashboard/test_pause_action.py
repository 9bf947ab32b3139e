"""End to end: the pause button on the loop page, the real admin route, the loop's state.

In a module of its own because the Temporal dev server (a session fixture) must start
before this module's browser: async fixtures cannot start while Playwright's sync API
holds the event loop, and a failed session fixture stays failed for the whole run.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import httpx
from sqlalchemy import select
from temporalio.testing import WorkflowEnvironment

from services.db.models import Loop
from services.db.session import create_db_engine, make_session_factory
from tests.services.dashboard.conftest import (
    ADMIN_TOKEN,
    BrowserPage,
    dashboard_settings,
    live_server,
)
from tests.services.dashboard.seed import seed_story
from tests.support import assert_eventually


def test_pause_action_pauses_the_loop(
    temporal_env: WorkflowEnvironment, database_url: str, tmp_path: Path, browser_page: BrowserPage
) -> None:
    # A loop name and task queue of its own: the admin route signals with start, so the
    # loop's workflow stays pending in the session's Temporal, where no worker polls it.
    name = f"pause-{uuid.uuid4().hex[:8]}"
    address = temporal_env.client.service_client.config.target_host
    engine = create_db_engine(database_url, pool_size=2, application="ratchet-dashboard-tests")
    try:
        session_factory = make_session_factory(engine)
        with session_factory.begin() as session:
            story = seed_story(
                session,
                now=dt.datetime.now(dt.UTC),
                artifacts_dir=tmp_path / "artifacts",
                name=name,
            )
        settings = dashboard_settings(
            database_url,
            tmp_path,
            temporal_address=address,
            temporal_task_queue=f"dashboard-{name}",
        )
        with live_server(settings, engine) as server:
            # Without the token the admin route refuses, and the loop stays active.
            refused = httpx.post(f"{server.url}/v1/loops/{story.loop}/pause", json={})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "unauthorized"

            page = browser_page.page
            response = page.goto(f"{server.url}/loops/{story.loop}")
            assert response is not None and response.status == 200
            page.fill("#admin-token", ADMIN_TOKEN)
            page.click("#token-save")
            page.fill("#action-reason", "maintenance window")
            with page.expect_navigation():
                page.click("button[data-action='pause']")

            def paused() -> None:
                with session_factory() as session:
                    status = session.scalars(
                        select(Loop.status).where(Loop.name == story.loop)
                    ).one()
                assert status == "paused"

            assert_eventually(paused, timeout=30)
            page.reload()
            assert "paused" in page.locator("#summary h1").inner_text()
            assert page.locator("#status-reason").inner_text() == "maintenance window"
            assert page.locator("button[data-action='resume']").count() == 1
            assert page.locator("button[data-action='pause']").count() == 0
    finally:
        engine.dispose()
    assert browser_page.errors == []

"""The loop page of a new loop says what its next cycle waits for, each with the command
that supplies it, and when its pending traces will be curated (headless Chromium)."""

from __future__ import annotations

import httpx
from ratchet_client import TraceClient

from tests.services.api.support import make_trace
from tests.services.dashboard.conftest import ADMIN_TOKEN, BrowserPage, LiveServer


def test_a_new_loop_page_says_what_the_next_cycle_waits_for(
    empty_server: LiveServer, browser_page: BrowserPage
) -> None:
    created = httpx.post(
        f"{empty_server.url}/v1/loops",
        json={"name": "fresh", "environment": "toolcalc", "trigger_policy": {"min_new_tasks": 16}},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    with TraceClient(empty_server.url, "fresh", created.json()["signing_secret"]) as client:
        assert client.post([make_trace("f-1"), make_trace("f-2"), make_trace("f-3")]).accepted == 3

    page = browser_page.page
    response = page.goto(f"{empty_server.url}/loops/fresh")
    assert response is not None and response.status == 200
    panel = page.locator("#next-cycle")
    assert panel.locator("h3").inner_text() == "The next cycle waits for"
    items = panel.locator("li").all_inner_texts()
    assert items[0] == "0 of 16 new train tasks (trigger_policy.min_new_tasks)"
    assert items[1].startswith("no eval tasks yet")
    assert items[2].startswith("no champion: run ratchet loop bootstrap fresh")
    commands = panel.locator("li code").all_inner_texts()
    assert commands == [
        "ratchet loop bootstrap fresh",
        "ratchet models smollm2 --import --loop fresh",
        "ratchet models import DIR --loop fresh",
    ]
    assert page.locator("#pending-curation").inner_text() == (
        "3 traces wait for curation: curated at the loop's next trigger check (every 30 s "
        "while the loop waits)"
    )
    assert browser_page.errors == []

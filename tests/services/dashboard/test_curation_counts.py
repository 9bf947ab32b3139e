"""The loop page says why traces did not become tasks: counts by curation outcome and
reason, with an example trace each, read in a real headless Chromium."""

from __future__ import annotations

import httpx
from ratchet_client import TraceClient
from sqlalchemy import select

from services.db.models import Trace
from services.db.queries.traces import Verdict, mark_traces_curated
from tests.services.api.support import make_trace
from tests.services.dashboard.conftest import ADMIN_TOKEN, BrowserPage, LiveServer

VERDICTS = {
    "order-1": ("rejected", "unknown_api_version: tool list ['lookup_order'] matches none"),
    "order-2": ("rejected", "unknown_api_version: tool list ['lookup_order'] matches none"),
    "order-3": ("rejected", "unknown_api_version: tool list ['refund'] matches none"),
    "order-4": ("rejected", "unverifiable_request: no reference answer"),
    "order-5": ("skipped", "no outcome reported"),
}


def test_the_loop_page_counts_traces_by_curation_outcome_and_reason(
    empty_server: LiveServer, browser_page: BrowserPage
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    created = httpx.post(
        f"{empty_server.url}/v1/loops",
        json={"name": "orders", "environment": "toolcalc"},
        headers=admin,
        timeout=30,
    )
    assert created.status_code == 201, created.text
    secret = created.json()["signing_secret"]
    traces = [make_trace(external_id) for external_id in [*VERDICTS, "order-6"]]
    with TraceClient(empty_server.url, "orders", secret) as client:
        posted = client.post(traces)
    assert posted.accepted == 6
    with empty_server.session_factory.begin() as session:
        ids = dict(session.execute(select(Trace.external_id, Trace.id)).all())
        mark_traces_curated(
            session=session,
            verdicts=[Verdict(ids[name], *verdict) for name, verdict in VERDICTS.items()],
        )

    page = browser_page.page
    response = page.goto(f"{empty_server.url}/loops/orders")
    assert response is not None and response.status == 200
    rows = page.locator("#curation-table tbody tr")
    read = {
        (row.get_attribute("data-outcome"), row.get_attribute("data-reason")): (
            int(row.locator(".count").inner_text()),
            row.locator(".example").inner_text(),
        )
        for row in rows.all()
    }
    assert read == {
        ("pending", ""): (1, "order-6"),
        ("rejected", "unknown_api_version"): (3, "order-3"),
        ("rejected", "unverifiable_request"): (1, "order-4"),
        ("skipped", "no outcome reported"): (1, "order-5"),
    }
    assert rows.first.get_attribute("data-outcome") == "pending"
    text = page.locator("#curation").inner_text()
    assert "ratchet traces show ID --loop orders" in text
    assert (
        "the table above says what curation made of each trace"
        in page.locator("#clusters").inner_text()
    )
    assert browser_page.errors == []

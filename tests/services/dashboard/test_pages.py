"""The dashboard in a real browser: headless Chromium (Debian's) driven by Playwright,
against a real uvicorn server of ``create_app`` over a real Postgres holding a realistic
loop history (see ``seed.py``)."""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import httpx
from playwright.sync_api import Page, Request, Route
from sqlalchemy import select

from services.dashboard.queries import live_success_series
from services.db.models import Loop
from tests.services.dashboard.conftest import (
    ADMIN_TOKEN,
    TEMPORAL_UI,
    BrowserPage,
    LiveServer,
    Seeded,
)
from tests.services.dashboard.seed import (
    TRACE_SECRET,
    XSS_LOG_LINE,
    XSS_PROMPT,
    XSS_REASON,
    XSS_SIGNATURE,
)

WORKFLOWS = f"{TEMPORAL_UI}/namespaces/default/workflows"


def _open(browser_page: BrowserPage, url: str, status: int = 200) -> Page:
    response = browser_page.page.goto(url)
    assert response is not None and response.status == status, url
    return browser_page.page


def _open_run(seeded: Seeded, browser_page: BrowserPage, run_id: str) -> Page:
    """The page of one of the main loop's runs."""
    return _open(browser_page, f"{seeded.server.url}/loops/{seeded.story.loop}/runs/{run_id}")


def _no_xss(page: Page) -> None:
    assert page.evaluate("typeof window.__xss") == "undefined"
    assert page.locator("img[src='x']").count() == 0
    assert TRACE_SECRET not in page.content()


def test_overview_lists_every_loop(seeded: Seeded, browser_page: BrowserPage) -> None:
    story = seeded.story
    page = _open(browser_page, seeded.server.url + "/")
    rows = page.locator("#loops-table tbody tr")
    assert rows.count() == 2
    busy = page.locator(f"tr[data-loop='{story.loop}']")
    text = busy.inner_text()
    for expected in ("train", story.champion_checkpoint[:12], "#3", "$3.80", "$25.00"):
        assert expected in text
    assert re.search(r"\d+/200 of the latest traces", text)
    quiet = page.locator(f"tr[data-loop='{story.quiet_loop}']").inner_text()
    assert "idle" in quiet and "none yet" in quiet and "no cycles yet" in quiet
    _no_xss(page)
    assert browser_page.errors == []

    page.click(f"a.loop-link:text('{story.loop}')")
    page.wait_for_url(f"**/loops/{story.loop}")
    assert story.loop in page.title()


def test_loop_page_shows_the_whole_loop(seeded: Seeded, browser_page: BrowserPage) -> None:
    story = seeded.story
    page = _open(browser_page, f"{seeded.server.url}/loops/{story.loop}")

    assert "active" in page.locator("#summary h1").inner_text()
    overview_rate = re.search(
        r"\d+/200 of the latest traces", page.locator("#summary").inner_text()
    )
    assert overview_rate is not None  # the same measure as the overview's
    steps = page.locator("#timeline li.step")
    states = {
        steps.nth(i).get_attribute("data-stage"): steps.nth(i).get_attribute("data-state")
        for i in range(steps.count())
    }
    assert states["curate"] == states["snapshot"] == "done"
    assert states["train"] == "current"
    assert states["evaluate"] == states["account"] == "pending"

    with seeded.server.session_factory() as session:
        loop_id = session.scalars(select(Loop.id).where(Loop.name == story.loop)).one()
        series = live_success_series(session=session, loop_id=loop_id)
    assert series is not None
    live = page.locator("#live svg")
    assert live.locator("circle.point").count() == len(series.buckets) > 20
    assert live.locator("polyline.line").count() == 1
    assert live.locator("line.marker-promote").count() == 2
    assert live.locator("line.marker-rollback").count() == 1
    assert live.locator("line.marker-drift").count() == 1

    evaluations = page.locator("#evaluations svg")
    assert evaluations.locator("circle.point").count() == 4  # two cycles, two checkpoints each
    assert evaluations.locator("line.ci").count() == 12  # a whisker and two caps each

    assert page.locator("#cycles-table tbody tr").count() == 3
    cycle2 = page.locator("#cycles-table tr[data-cycle='2']").inner_text()
    for expected in ("drift", "25.0%", "83.3%", "promote", "58.3", "$2.10"):
        assert expected in cycle2
    # Proof of delivery of each deploy: verified, or not and why.
    delivery = page.locator("#cycles-table tr[data-cycle='1'] span.delivery")
    assert [delivery.nth(i).inner_text() for i in range(delivery.count())] == [
        "candidate: verified: 4 probes match on token ids and log-probs",
        "rollback: not verified: no probe set",
    ]
    assert delivery.nth(0).get_attribute("class") == "delivery verified"
    assert delivery.nth(1).get_attribute("class") == "delivery unverified"
    # The three numbers, each on its own set, with intervals (DESIGN §8).
    numbers = page.locator("#cycles-table tr[data-cycle='2'] span.number")
    assert [numbers.nth(i).inner_text() for i in range(numbers.count())] == [
        "held-out +58.3 [40.1, 72.4] 40 tasks",
        "gate +91.7 [75.0, 100.0] 12 tasks",
        "live +41.0 [22.5, 55.2] 40 → 60 traces",
    ]
    assert page.locator("#cost svg rect.bar").count() == 3
    assert "16.66" in page.locator("#ppd-total").inner_text()

    checkpoint = page.locator("#lineage-checkpoint code.id").first
    assert checkpoint.get_attribute("title") == story.champion_checkpoint
    assert page.locator("#lineage-run a").inner_text() == story.cycle2_train_run
    assert "cycle #2" in page.locator("#lineage-promotion").inner_text()
    assert (
        f"{story.cycle2_task_count} tasks in 3 clusters"
        in page.locator("#lineage-tasks").inner_text()
    )
    assert story.base_checkpoint[:12] in page.locator("#lineage-checkpoint").inner_text()

    clusters = page.locator("#clusters details.cluster")
    assert clusters.count() == 3
    assert clusters.first.get_attribute("data-cluster") == "c-lookup-renamed"
    assert clusters.first.locator("pre.prompt").count() == 3
    assert page.locator("#runs-table tbody tr").count() == 5

    assert page.locator("#summary a.temporal").first.get_attribute("href") == (
        f"{WORKFLOWS}/loop%2F{story.loop}"
    )
    cycle3_links = page.locator("#cycles-table tr[data-cycle='3'] a.temporal")
    assert [cycle3_links.nth(i).inner_text() for i in range(cycle3_links.count())] == [
        "curate",
        "train",
    ]
    assert cycle3_links.nth(1).get_attribute("href") == (
        f"{WORKFLOWS}/loop%2F{story.loop}%2Fcycle%2F3%2Ftrain"
    )
    assert browser_page.errors == []


def test_the_cycle_shows_its_estimate_beside_the_actual_and_where_the_money_went(
    seeded: Seeded, browser_page: BrowserPage
) -> None:
    page = _open(browser_page, f"{seeded.server.url}/loops/{seeded.story.loop}")
    summary = page.locator("#estimate-vs-actual").inner_text()
    assert "Estimate $1.90 ($1.50 to $2.40)" in summary and "so far" in summary
    assert "measured over 2 cycle(s)" in summary and "$21.20" in summary
    phases = page.locator("#cost-by-phase tbody tr")
    assert [phases.nth(i).get_attribute("data-phase") for i in range(phases.count())] == [
        "rollout",
        "update",
        "evaluation",
    ]
    assert "$0.90" in page.locator("#cost-by-phase tr[data-phase='rollout']").inner_text()
    # a closed cycle: its actual beside its estimate, and the actual by phase
    cost = page.locator("#cycles-table tr[data-cycle='2'] td.cost")
    assert cost.inner_text() == "$2.10 est. $2.00"
    assert (
        cost.get_attribute("title") == "by phase: rollout $1.20 · update $0.30 · evaluation $0.60"
    )
    assert browser_page.errors == []


def test_run_page_shows_status_logs_and_workflows(
    seeded: Seeded, browser_page: BrowserPage
) -> None:
    story = seeded.story
    page = _open_run(seeded, browser_page, story.cycle3_train_run)
    assert "running" in page.locator("#run-summary h1").inner_text()
    log = page.locator("#log-tail").inner_text()
    assert log.splitlines() == ["INFO starting GRPO", XSS_LOG_LINE, "step 13 loss=0.40"]
    links = page.locator("#workflows a.temporal")
    assert [links.nth(i).get_attribute("href") for i in range(links.count())] == [
        f"{WORKFLOWS}/loop%2F{story.loop}",
        f"{WORKFLOWS}/loop%2F{story.loop}%2Fcycle%2F3%2Ftrain",
    ]
    _no_xss(page)

    page = _open_run(seeded, browser_page, story.cycle2_train_run)
    lines = page.locator("#log-tail").inner_text().splitlines()
    assert len(lines) == 200 and lines[-1] == "step 399 loss=0.003"
    assert "Last 200 lines" in page.locator("#logs").inner_text()
    assert story.champion_checkpoint[:12] in page.locator("#outputs").inner_text()
    # where its $1.60 went: the phases its job reported, the rest of its 6.4 hours as other
    phases = page.locator("#run-cost-by-phase tbody tr")
    assert [phases.nth(i).inner_text().split("\t") for i in range(phases.count())] == [
        ["rollout", "4h 00m", "4h 00m", "$1.00"],
        ["update", "2h 00m", "2h 00m", "$0.50"],
        ["other", "23m 55s", "23m 55s", "$0.10"],
    ]
    assert browser_page.errors == []


def test_a_log_outside_the_state_directory_is_not_shown(
    seeded: Seeded, browser_page: BrowserPage
) -> None:
    page = _open_run(seeded, browser_page, seeded.story.outside_logs_run)
    assert "outside" in page.locator("#logs-unavailable").inner_text()
    assert "root:" not in page.content()
    assert browser_page.errors == []


def test_user_data_is_escaped_everywhere(seeded: Seeded, browser_page: BrowserPage) -> None:
    story = seeded.story
    base = seeded.server.url
    page = _open(browser_page, base + "/")
    _no_xss(page)
    page = _open(browser_page, f"{base}/loops/{story.loop}")
    _no_xss(page)
    assert page.locator("#status-reason").inner_text() == XSS_REASON
    date_cluster = page.locator("details[data-cluster='c-date-format']")
    assert XSS_SIGNATURE in (date_cluster.locator("summary").text_content() or "")
    assert XSS_PROMPT not in page.content()  # a prompt is shown only with the admin token
    page.evaluate(f"sessionStorage.setItem('ratchet.adminToken', {ADMIN_TOKEN!r})")
    page = _open(browser_page, f"{base}/loops/{story.loop}")
    date_cluster = page.locator("details[data-cluster='c-date-format']")
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('pre[data-task-prompt]'))"
        ".every((pre) => !pre.hidden)"
    )
    prompts = [p.text_content() for p in date_cluster.locator("pre.prompt").all()]
    assert XSS_PROMPT in prompts
    _no_xss(page)
    page.evaluate("sessionStorage.clear()")
    assert page.locator("#clusters script, #clusters b").count() == 0

    evil_name = "<svg onload=window.__xss=9>"  # a loop name is one path segment: no slash
    page = _open(browser_page, f"{base}/loops/{quote(evil_name, safe='')}", status=404)
    assert evil_name in page.locator("#not-found").inner_text()
    _no_xss(page)
    evil = '<script>window.__xss="run"</script>'  # a run id may hold slashes
    _no_xss(page)
    page = _open(browser_page, f"{base}/loops/{story.loop}/runs/{quote(evil, safe='')}", status=404)
    assert evil in page.locator("#not-found").inner_text()
    _no_xss(page)
    assert [e for e in browser_page.errors if "404" not in e] == []


def test_empty_states(seeded: Seeded, empty_server: LiveServer, browser_page: BrowserPage) -> None:
    page = _open(browser_page, empty_server.url + "/")
    assert "No loops yet" in page.locator("#empty-loops").inner_text()
    assert "/v1/loops/{loop}/traces" in page.locator("#empty-loops").inner_text()
    assert page.locator("#loops-table").count() == 0

    page = _open(browser_page, f"{seeded.server.url}/loops/{seeded.story.quiet_loop}")
    assert "No cycles yet" in page.locator("#empty-cycles").inner_text()
    for section in ("#live", "#evaluations", "#cycles", "#cost", "#lineage", "#clusters", "#runs"):
        assert page.locator(f"{section} .empty").count() == 1, section
        assert page.locator(f"{section} svg").count() == 0, section
    assert "idle" in page.locator("#summary").inner_text()
    live_hint = page.locator("#live .empty").inner_text()
    assert f"/v1/loops/{seeded.story.quiet_loop}/traces" in live_hint
    assert browser_page.errors == []


def test_pages_are_read_only_without_the_token(seeded: Seeded, browser_page: BrowserPage) -> None:
    page = browser_page.page
    writes: list[str] = []
    page.on("request", lambda r: writes.append(r.url) if r.method != "GET" else None)
    _open(browser_page, f"{seeded.server.url}/loops/{seeded.story.loop}")
    assert page.locator("#readonly-note").is_visible()
    assert page.locator("#action-panel").is_hidden()
    buttons = page.locator("button.action")
    assert buttons.count() >= 4
    assert all(buttons.nth(i).is_disabled() for i in range(buttons.count()))
    assert page.evaluate("sessionStorage.getItem('ratchet.adminToken')") is None
    for path in ("/", f"/loops/{seeded.story.loop}/runs/{seeded.story.cycle3_train_run}"):
        _open(browser_page, seeded.server.url + path)
    assert writes == []
    assert browser_page.errors == []


class AdminApiStandIn:
    """Answers the admin action calls inside the browser, recording what the page sent."""

    def __init__(self, page: Page) -> None:
        self.requests: list[Request] = []
        self.status = 202
        self.body: dict[str, object] = {"status": "accepted"}
        page.route(re.compile(r".*/v1/loops/[^/]+/[^/]+$"), self._handle)

    def _handle(self, route: Route) -> None:
        self.requests.append(route.request)
        route.fulfill(
            status=self.status, content_type="application/json", body=json.dumps(self.body)
        )


def test_actions_send_the_pasted_token_as_a_bearer_header(
    seeded: Seeded, browser_page: BrowserPage
) -> None:
    """The page's half of the action contract, with the admin API answered in the browser."""
    story = seeded.story
    page = _open(browser_page, f"{seeded.server.url}/loops/{story.loop}")
    api = AdminApiStandIn(page)
    page.fill("#admin-token", ADMIN_TOKEN)
    page.click("#token-save")
    assert page.locator("#action-panel").is_visible()
    assert page.input_value("#admin-token") == ""
    page.fill("#action-reason", "deploy freeze")
    with page.expect_navigation():
        page.click("button[data-action='pause']")

    (sent,) = api.requests
    assert sent.method == "POST"
    assert sent.url == f"{seeded.server.url}/v1/loops/{story.loop}/pause"
    assert sent.headers["authorization"] == f"Bearer {ADMIN_TOKEN}"
    assert sent.post_data_json == {"reason": "deploy freeze"}
    # The token lives in this tab's sessionStorage only: no cookie, not in any URL.
    assert page.evaluate("sessionStorage.getItem('ratchet.adminToken')") == ADMIN_TOKEN
    assert page.context.cookies() == [] and page.evaluate("document.cookie") == ""
    assert ADMIN_TOKEN not in page.url and ADMIN_TOKEN not in sent.url
    # After the reload the panel is still unlocked and says what happened.
    assert page.locator("#action-panel").is_visible()
    assert page.locator("#action-status").inner_text() == "Pause: accepted."

    api.status, api.body = 409, {"error": {"code": "conflict", "message": "<b>busy</b> now"}}
    page.click("button[data-action='run-now']")
    status = page.locator("#action-status")
    status.filter(has_text="conflict").wait_for()
    assert status.inner_text() == "conflict: <b>busy</b> now"
    assert status.locator("b").count() == 0
    assert api.requests[-1].post_data_json == {}

    page.once("dialog", lambda dialog: dialog.dismiss())
    page.click("button[data-action='rollback']")
    assert len(api.requests) == 2  # declining the confirmation sends nothing

    page.click("#token-forget")
    assert page.locator("#action-panel").is_hidden()
    assert page.evaluate("sessionStorage.getItem('ratchet.adminToken')") is None
    assert not [e for e in browser_page.errors if e.startswith("page error")]


def test_pages_carry_security_headers_and_static_files_are_served(seeded: Seeded) -> None:
    with httpx.Client(base_url=seeded.server.url) as client:
        page = client.get(f"/loops/{seeded.story.loop}")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "style-src 'self'" in policy
        assert "frame-ancestors 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-store"
        script = client.get("/static/dashboard/dashboard.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert "sessionStorage" in script.text
        assert (
            client.get("/static/dashboard/dashboard.css")
            .headers["content-type"]
            .startswith("text/css")
        )
        missing = client.get("/static/dashboard/..%2Fqueries.py")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        assert client.get("/loops/no-such-loop").status_code == 404
        assert client.get(f"/loops/{seeded.story.loop}/runs/no-such-run").status_code == 404

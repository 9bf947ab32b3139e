"""Both figures per champion on the loop page (a table and a chart over the loop's life) in
headless Chromium, and the same figures from ``GET /v1/loops/{loop}/ledger``, over the
seeded loop history with the tenures its deploys would have recorded."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from decimal import Decimal

import httpx
import pytest
from playwright.sync_api import Locator
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.dashboard.render import interval, pct, usd
from services.db.models import Cycle, Evaluation, Loop, ServingTenure, Trace
from services.db.queries.points import intelligence_per_dollar
from services.db.queries.serving_ledger import ChampionFigures, loop_champion_figures
from tests.services.dashboard.conftest import (
    ADMIN_TOKEN,
    BrowserPage,
    SeededDatabase,
    dashboard_settings,
    live_server,
)
from tests.services.dashboard.conftest import LiveServer as Server
from tests.services.dashboard.seed import Story

VALUE_PER_SUCCESS = 0.02


@pytest.fixture(scope="module")
def server(seeded_database: SeededDatabase) -> Iterator[Server]:
    """The seeded story plus the tenures of its four deploys (base, cycle 1's candidate
    rolled back, base again, cycle 2's candidate serving now)."""
    story = seeded_database.story
    hour = dt.timedelta(hours=1)
    spans = [
        (story.base_checkpoint, 0, 30, (2_000_000, 600_000, 500_000, 900.0)),
        (story.rolled_back_checkpoint, 30, 32, (150_000, 30_000, 40_000, 80.0)),
        (story.base_checkpoint, 32, 44, (900_000, 300_000, 200_000, 400.0)),
        (story.champion_checkpoint, 44, None, (1_500_000, 900_000, 300_000, 500.0)),
    ]
    with seeded_database.session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == story.loop)).one()
        loop.serving_target = {**loop.serving_target, "value_per_success_usd": VALUE_PER_SUCCESS}
        for checkpoint, start, end, (prompt, cached, completion, busy) in spans:
            session.add(
                ServingTenure(
                    loop_id=loop.id,
                    checkpoint_id=checkpoint,
                    prompt_tokens=prompt,
                    cached_prompt_tokens=cached,
                    completion_tokens=completion,
                    busy_seconds=busy,
                    cost_usd=Decimal(str(busy * 2.5 / 3600)),
                    started_at=story.start + start * hour,
                    ended_at=story.start + end * hour if end is not None else None,
                    sampled_at=story.start + (end or 50) * hour,
                )
            )
        # The story's traces name their versions "base" and "candidate"; a served trace
        # names the checkpoint id (the server's X-Ratchet-Model-Version).
        _name_versions(session, loop.id, story.start, story)
        cycle2 = session.scalars(
            select(Cycle).where(Cycle.loop_id == loop.id, Cycle.number == 2)
        ).one()
        session.add(
            Evaluation(
                loop_id=loop.id,
                cycle_id=cycle2.id,
                checkpoint_id=story.champion_checkpoint,
                task_set="heldout",
                n=40,
                passed=30,
                pass_rate=0.75,
                ci_low=0.6,
                ci_high=0.86,
            )
        )
    settings = dashboard_settings(seeded_database.url, seeded_database.state_dir)
    with live_server(settings, seeded_database.engine) as running:
        yield running


def _name_versions(session: Session, loop_id: int, start: dt.datetime, story: Story) -> None:
    rolled_back_until = start + dt.timedelta(hours=32)
    for old, new, where in [
        ("base", story.base_checkpoint, Trace.received_at.is_not(None)),
        ("candidate", story.rolled_back_checkpoint, Trace.received_at < rolled_back_until),
        ("candidate", story.champion_checkpoint, Trace.received_at >= rolled_back_until),
    ]:
        session.execute(
            update(Trace)
            .where(Trace.loop_id == loop_id, Trace.model_version == old, where)
            .values(model_version=new)
        )


def figures(server: Server, loop_name: str) -> list[ChampionFigures]:
    with server.session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == loop_name)).one()
        return loop_champion_figures(session=session, loop=loop, cached_token_weight=0.1)


def test_the_loop_page_shows_both_figures_per_champion(
    server: Server, seeded_database: SeededDatabase, browser_page: BrowserPage
) -> None:
    story = seeded_database.story
    expected = figures(server, story.loop)
    assert [f.checkpoint_id for f in expected] == [
        story.base_checkpoint,
        story.rolled_back_checkpoint,
        story.base_checkpoint,
        story.champion_checkpoint,
    ]
    champion = expected[-1]
    assert champion.usd_per_mtok is not None and champion.live_success_rate is not None
    assert champion.heldout_pass_rate == 0.75 and champion.cycle == 2

    page = browser_page.page
    response = page.goto(f"{server.url}/loops/{story.loop}")
    assert response is not None and response.status == 200
    rows = page.locator("#serving-table tbody tr")
    assert rows.count() == 4
    last = rows.nth(3)
    assert last.get_attribute("data-checkpoint") == story.champion_checkpoint

    def cell(field: str) -> Locator:
        return last.locator(f'[data-field="{field}"]')

    assert f"{champion.tokens_served:,}" in cell("tokens").inner_text()
    assert f"{champion.cached_prompt_tokens:,} cached" in cell("tokens").inner_text()
    assert usd(champion.usd_per_mtok) in cell("usd-per-mtok").inner_text()
    assert "cached" in cell("usd-per-mtok").inner_text()
    assert pct(champion.live_success_rate) in cell("live").inner_text()
    assert pct(champion.heldout_pass_rate) in cell("heldout").inner_text()
    # each with its 95 % interval and what it counted
    assert champion.live is not None
    assert f"{champion.live_successes}/{champion.live_episodes} episodes" in (
        cell("live").inner_text()
    )
    assert interval((champion.live.low, champion.live.high)) in cell("live").inner_text()
    assert "[60.0%, 86.0%] of 40 tasks" in cell("heldout").inner_text()
    assert usd(champion.usd_per_heldout_point) in cell("usd-per-point").inner_text()
    assert champion.break_even_tokens is not None  # it gained live success over the base
    assert f"{champion.break_even_tokens:,.0f} tokens" in cell("break-even").inner_text()
    assert "now" in last.inner_text()  # its tenure is open
    chart = page.locator("#serving-chart svg")
    assert chart.locator("circle.point").count() == 4  # every tenure that served tokens
    assert browser_page.errors == []


def test_the_api_answers_the_same_figures(server: Server, seeded_database: SeededDatabase) -> None:
    story = seeded_database.story
    expected = figures(server, story.loop)
    answer = httpx.get(
        f"{server.url}/v1/loops/{story.loop}/ledger",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["value_per_success_usd"] == VALUE_PER_SUCCESS
    assert [c["checkpoint_id"] for c in body["champions"]] == [f.checkpoint_id for f in expected]
    for got, want in zip(body["champions"], expected, strict=True):
        assert got["tokens_served"] == want.tokens_served
        assert got["usd_per_mtok"] == pytest.approx(want.usd_per_mtok)
        assert got["live_success_rate"] == want.live_success_rate
        assert got["live_successes"] == want.live_successes
        if want.heldout is not None:
            assert (got["heldout_tasks"], got["heldout_ci95"]) == (40, [0.6, 0.86])
        assert got["break_even_tokens"] == want.break_even_tokens
    missing = httpx.get(
        f"{server.url}/v1/loops/no-such-loop/ledger",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert missing.status_code == 404 and "no-such-loop" in missing.text
    refused = httpx.get(f"{server.url}/v1/loops/{story.loop}/ledger")
    assert refused.status_code == 401


def test_the_page_and_the_api_show_the_same_usd_per_point(
    server: Server, seeded_database: SeededDatabase, browser_page: BrowserPage
) -> None:
    """One read model (services.db.queries.points) behind both doors: the loop page's $ per
    held-out point of each champion's cycle is the api's, and the cumulative points per
    dollar on the page is the read model's."""
    story = seeded_database.story
    with server.session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == story.loop)).one()
        bought = intelligence_per_dollar(session=session, loop_id=loop.id)
    answer = httpx.get(
        f"{server.url}/v1/loops/{story.loop}/ledger",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert answer.status_code == 200, answer.text
    api = answer.json()["champions"]
    page = browser_page.page
    response = page.goto(f"{server.url}/loops/{story.loop}")
    assert response is not None and response.status == 200
    rows = page.locator("#serving-table tbody tr")
    assert rows.count() == len(api) == 4
    for index, champion in enumerate(api):
        shown = rows.nth(index).locator('[data-field="usd-per-point"]').inner_text().strip()
        assert shown == usd(champion["usd_per_heldout_point"])
    cycle2 = bought.of_cycle(2)
    assert cycle2 is not None and cycle2.usd_per_point is not None
    assert api[-1]["cycle"] == 2
    assert api[-1]["usd_per_heldout_point"] == pytest.approx(cycle2.usd_per_point)
    assert api[-1]["cycle_cost_usd"] == pytest.approx(cycle2.cost_usd)
    cumulative = bought.points_per_dollar
    assert cumulative is not None
    assert f"{cumulative:,.2f}" in page.locator("#ppd-total").inner_text()
    assert browser_page.errors == []

"""The loop page shows how often the judge agreed with the rule: the eval jobs'
``judge_agreement`` metrics (the path the judge's usage already takes, runs.metrics), read
by the dashboard's query and served on the loop page."""

from __future__ import annotations

import httpx
from sqlalchemy import select

from services.dashboard.queries import judge_agreement
from services.db.models import Loop, Run
from tests.services.dashboard.conftest import ADMIN_TOKEN, LiveServer

AGREEMENT = {
    "grader": {
        "both_pass": 30,
        "both_fail": 8,
        "rule_only": 1,
        "judge_only": 1,
        "unparseable": 1,
        "errors": 2,
        "episodes": 40,
        "agreed": 38,
        "share": 0.95,
        "ci_low": 0.835,
        "ci_high": 0.986,
    }
}


def test_the_loop_page_shows_the_judges_agreement_with_the_rule(empty_server: LiveServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    created = httpx.post(
        f"{empty_server.url}/v1/loops",
        json={"name": "flights", "environment": "replay"},
        headers=admin,
        timeout=30,
    )
    assert created.status_code == 201, created.text
    page = httpx.get(f"{empty_server.url}/loops/flights", timeout=30)
    assert page.status_code == 200 and "judge-agreement" not in page.text  # nothing yet

    with empty_server.session_factory.begin() as session:
        loop_id = session.scalars(select(Loop.id).where(Loop.name == "flights")).one()
        for run_id, kind, metrics in (
            ("e-1", "eval", {"pass_rate": 0.5, "judge_agreement": AGREEMENT}),
            ("e-0", "eval", {"pass_rate": 0.4}),  # no judge beside the rule
            ("t-1", "train", {"judge_agreement": AGREEMENT}),  # only eval jobs count
        ):
            session.add(
                Run(
                    id=run_id,
                    loop_id=loop_id,
                    kind=kind,
                    executor="local",
                    spec={},
                    status="succeeded",
                    metrics=metrics,
                )
            )
    with empty_server.session_factory() as session:
        (row,) = judge_agreement(session=session, loop_id=loop_id)
    assert (row.run_id, row.judge, row.episodes, row.agreed) == ("e-1", "grader", 40, 38)
    low, high = row.interval
    assert low < row.share == 0.95 < high  # type: ignore[operator]

    page = httpx.get(f"{empty_server.url}/loops/flights", timeout=30)
    assert page.status_code == 200
    assert 'id="judge-agreement-table"' in page.text
    assert 'data-run="e-1" data-judge="grader"' in page.text
    assert "38/40" in page.text and "95%" in page.text

"""``ratchet loop show`` prints both figures per champion from the serving ledger."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

import pytest
from sqlalchemy import select

from services.db.models import Checkpoint, Cycle, Evaluation, Loop, ServingTenure
from services.db.session import SessionFactory
from tests.services.cli.support import run


def test_loop_show_prints_both_figures_per_champion(
    api_url: str, session_factory: SessionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(capsys, "loop", "create", "calc", "--env", "toolcalc", "--show-secrets")
    assert code == 0
    code, out, _ = run(capsys, "loop", "show", "calc")
    assert code == 0 and "serving " not in out  # no tenure yet: no ledger lines

    start = dt.datetime(2026, 12, 1, 8, 0, tzinfo=dt.UTC)
    with session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "calc")).one()
        for name in ("a" * 64, "b" * 64):
            session.add(
                Checkpoint(
                    id=name,
                    loop_id=loop.id,
                    uri=f"file:///artifacts/{name}",
                    format="ratchet.tiny/v1",
                    size_bytes=1,
                    sha256="0" * 64,
                    manifest={},
                )
            )
        session.flush()
        session.add_all(
            [
                ServingTenure(
                    loop_id=loop.id,
                    checkpoint_id="a" * 64,
                    prompt_tokens=800_000,
                    cached_prompt_tokens=200_000,
                    completion_tokens=200_000,
                    busy_seconds=3600.0,
                    cost_usd=Decimal("2.5"),
                    started_at=start,
                    ended_at=start + dt.timedelta(hours=5),
                ),
                ServingTenure(
                    loop_id=loop.id,
                    checkpoint_id="b" * 64,
                    started_at=start + dt.timedelta(hours=5),
                ),
            ]
        )

    code, out, _ = run(capsys, "loop", "show", "calc")
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "$/MTOK" in line)
    first, second = lines[header + 1], lines[header + 2]
    assert first.split()[:4] == ["aaaaaaaaaaaa", "1,000,000", "200,000", "$2.50"]
    assert "to 2026-12-01 13:00" in first
    assert second.split()[:4] == ["bbbbbbbbbbbb", "0", "0", "-"] and second.endswith("to now")
    assert "no value_per_success_usd" in out


def test_loop_show_prints_every_figure_with_its_interval_and_counts(
    api_url: str, session_factory: SessionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The latest cycles' three numbers and each champion's held-out pass rate, each with
    its 95 % interval and what it counted."""
    code, _, _ = run(capsys, "loop", "create", "sure", "--env", "toolcalc", "--show-secrets")
    assert code == 0
    start = dt.datetime(2026, 12, 1, 8, 0, tzinfo=dt.UTC)
    with session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "sure")).one()
        session.add(
            Checkpoint(
                id="c" * 64,
                loop_id=loop.id,
                uri="file:///artifacts/c",
                format="ratchet.tiny/v1",
                size_bytes=1,
                sha256="0" * 64,
                manifest={},
            )
        )
        session.flush()
        session.add_all(
            [
                ServingTenure(loop_id=loop.id, checkpoint_id="c" * 64, started_at=start),
                Evaluation(
                    loop_id=loop.id,
                    checkpoint_id="c" * 64,
                    task_set="heldout",
                    n=40,
                    passed=30,
                    pass_rate=0.75,
                    ci_low=0.6,
                    ci_high=0.86,
                ),
                Cycle(
                    loop_id=loop.id,
                    number=1,
                    trigger="operator",
                    stage="done",
                    outcome="promoted",
                    points_gained=58.3,
                    points_detail={
                        "heldout": {
                            "points": 58.3,
                            "ci_low_points": 40.1,
                            "ci_high_points": 72.4,
                            "n": 40,
                        },
                        "live": {
                            "points": 41.0,
                            "ci_low_points": 22.5,
                            "ci_high_points": 55.2,
                            "n_before": 40,
                            "n_after": 60,
                        },
                    },
                ),
            ]
        )
    code, out, _ = run(capsys, "loop", "show", "sure")
    assert code == 0
    assert (
        "       1  promoted     held-out +58.3 [+40.1, +72.4] pts (40 tasks) · "
        "live +41.0 [+22.5, +55.2] pts (40 → 60 traces), +58.3 gained"
    ) in out
    assert "75% [60, 86] 40 tasks" in out
    code, out, _ = run(capsys, "loop", "show", "sure", "--json")
    (cycle,) = json.loads(out)["cycles"]
    assert cycle["heldout"] == {
        "points": 58.3,
        "ci95_points": [40.1, 72.4],
        "n": 40,
        "method": "paired_bootstrap",
        "n_before": None,
    }
    assert cycle["live"]["method"] == "newcombe" and cycle["gate"] is None

"""``ratchet loop show`` prints both figures per champion from the serving ledger."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pytest
from sqlalchemy import select

from services.db.models import Checkpoint, Loop, ServingTenure
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

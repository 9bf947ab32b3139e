"""A cycle the estimate refuses: `ratchet loop show` says the loop paused and why."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from services.db.models import Cycle, Loop
from services.db.session import SessionFactory
from services.loop.estimate import Prices
from services.loop.policies import TrainingProfile
from tests.services.cli.support import run
from workflows.activities.estimate import EstimateActivities, EstimateInput


def test_loop_show_gives_the_refused_cycles_reason(
    api_url: str, session_factory: SessionFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(
        capsys,
        "loop",
        "create",
        "thrifty",
        "--env",
        "toolcalc",
        "--budget-usd",
        "0.01",
        "--show-secrets",
    )
    assert code == 0
    with session_factory.begin() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "thrifty")).one()
        session.add(Cycle(loop_id=loop.id, number=1, trigger="operator", stage="snapshot"))
    estimate = EstimateActivities(session_factory, Prices(2.5, 0.04)).estimate_cycle(
        EstimateInput(
            "thrifty",
            1,
            TrainingProfile(accelerators=8, hyperparameters={"steps": 100}),
            eval_task_counts=[50],
            samples_per_task=4,
        )
    )
    assert not estimate.fits

    code, out, _ = run(capsys, "loop", "show", "thrifty")
    assert code == 0
    first = out.splitlines()[0]
    assert first.startswith("loop thrifty (paused: cycle 1 refused: estimated $")
    assert "exceeds the $0.0100 left of the loop's $0.01 budget" in first

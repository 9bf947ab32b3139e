"""Live outcomes (services.db.queries.live): the canary's, the ledger's, the demo's and the
dashboard's live success rate are one query, on real Postgres."""

from __future__ import annotations

import datetime as dt

from services.db.models import Loop
from services.db.queries.live import LIVE_WINDOW_TRACES, live_counts
from services.db.queries.loop_overview import loops_overview
from tests.services.dashboard.seed import _success_rate
from tests.services.db.conftest import Seeded


def _succeeded(indices: range) -> int:
    return sum(1 for i in indices if (i * 7) % 20 < _success_rate(i / 4) * 20)


def test_the_latest_outcomes_are_the_overviews_live_rate(seeded: Seeded) -> None:
    with seeded.sessions() as session:
        loop = session.get(Loop, seeded.loop_id)
        assert loop is not None
        recent = live_counts(session=session, loop=loop)
        overview = {s.name: s for s in loops_overview(session=session)}[seeded.story.loop]
    # One trace every 15 minutes for 72 hours: the latest 200 are traces 88..287.
    assert recent.n == LIVE_WINDOW_TRACES
    assert recent.successes == _succeeded(range(88, 288))
    assert (overview.live_passed, overview.live_n) == (recent.successes, recent.n)
    assert recent.rate == overview.live_rate
    low, high = recent.interval
    assert recent.rate is not None and low < recent.rate < high


def test_a_version_in_a_window(seeded: Seeded) -> None:
    """The canary's question: the traces of one version between two instants."""
    start = seeded.story.start
    with seeded.sessions() as session:
        loop = session.get(Loop, seeded.loop_id)
        assert loop is not None
        candidate = live_counts(
            session=session,
            loop=loop,
            model_version="candidate",
            since=start + dt.timedelta(hours=30),
            until=start + dt.timedelta(hours=32),
            limit=1_000,
        )
        newest = live_counts(session=session, loop=loop, limit=4)
        nothing = live_counts(session=session, loop=loop, model_version="never-served")
    assert candidate.n == 8  # hours 30 to 32, every 15 minutes, end excluded
    assert candidate.successes == _succeeded(range(120, 128))
    assert newest.n == 4
    assert (nothing.n, nothing.successes, nothing.rate) == (0, 0, None)


def test_attested_traces_only(seeded: Seeded) -> None:
    """With an attestation check, traces the server does not vouch for are left out, and
    the window is filled after the filter: every trace was read looking for one that counts
    (one every 15 minutes for 72 hours: 288)."""
    with seeded.sessions() as session:
        loop = session.get(Loop, seeded.loop_id)
        assert loop is not None
        counts = live_counts(session=session, loop=loop, attested=lambda version, ids: False)
    assert (counts.n, counts.unattested) == (0, 288)

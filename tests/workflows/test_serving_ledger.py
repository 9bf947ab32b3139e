"""The serving ledger kept by the loop's activities against a real Postgres: a tenure opens at
its version's verified deploy and ends at its replacement, samples add the counters' growth
(a server restart's reset read as a restart, never a negative), and an unreadable server
never fails a deploy.

The serving target and its /metrics are the dependencies replaced: a recorder that serves
what it was asked to, and a reader returning the counters a test sets (the real reader is
tested against a real ``ratchet serve`` in tests/services/serving/test_usage.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.client import Client
from temporalio.service import RPCError

from services.db.models import Cycle, Evaluation, Loop, ServingTenure, Trace
from services.db.queries.serving_ledger import champion_figures, serving_totals
from services.db.session import SessionFactory
from services.loop.ledger import ServingLedger, ServingPrices
from services.loop.policies import ServingTarget
from services.modelserver.usage import UsageUnavailable, VersionUsage
from tests.workflows.test_loop_activities import (
    RecordingTarget,
    add_checkpoint,
    add_cycle,
    make_loop,
    set_champion,
)
from workflows.activities.stages import StageActivities
from workflows.payloads.cycle import CloseCycleInput
from workflows.payloads.ledger import SERVING_LEDGER_SCHEDULE_ID, ServingLedgerInput
from workflows.payloads.promote import DeployInput
from workflows.schedules import ensure_serving_ledger_schedule

PRICES = ServingPrices(hour_usd=36.0, cached_token_weight=0.1)  # $0.01 per busy second


class Counters:
    """What the server's /metrics says now, per version; ``down`` makes it unreadable."""

    def __init__(self) -> None:
        self.now: dict[str, VersionUsage] = {}
        self.down = False

    def __call__(self, serving_target: Mapping[str, Any]) -> Mapping[str, VersionUsage]:
        if self.down:
            raise UsageUnavailable("connection refused")
        return dict(self.now)


@pytest.fixture
def counters() -> Counters:
    return Counters()


@pytest.fixture
def activities(session_factory: SessionFactory, counters: Counters) -> StageActivities:
    return StageActivities.build(
        session_factory,
        RecordingTarget(),
        serving_ledger=ServingLedger(read=counters, prices=PRICES),
    )


def deploy(activities: StageActivities, loop: str, checkpoint: str) -> None:
    activities.deploy.deploy_checkpoint(
        DeployInput(loop, ServingTarget(kind="local"), checkpoint, f"file:///{checkpoint}")
    )


def tenures(session_factory: SessionFactory, loop_id: int) -> list[ServingTenure]:
    with session_factory() as session:
        return list(
            session.scalars(
                select(ServingTenure)
                .where(ServingTenure.loop_id == loop_id)
                .order_by(ServingTenure.id)
            )
        )


def test_a_tenure_ends_at_its_replacement_with_what_it_served(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "first", 0)
    second = add_checkpoint(session_factory, loop_id, "second", 1)
    counters.now = {first: VersionUsage(10, 0, 5, 1.0)}  # served before the ledger began
    deploy(activities, name, first)
    (opened,) = tenures(session_factory, loop_id)
    assert (opened.checkpoint_id, opened.ended_at, opened.prompt_tokens) == (first, None, 0)

    counters.now = {
        first: VersionUsage(1010, 400, 505, 101.0),
        second: VersionUsage(7, 0, 3, 0.5),  # the candidate's traffic is not the first's
    }
    deploy(activities, name, second)

    ended, current = tenures(session_factory, loop_id)
    assert ended.checkpoint_id == first and ended.ended_at is not None
    assert ended.ended_at == current.started_at
    assert (ended.prompt_tokens, ended.cached_prompt_tokens, ended.completion_tokens) == (
        1000,
        400,
        500,
    )
    assert ended.busy_seconds == pytest.approx(100.0)
    assert float(ended.cost_usd) == pytest.approx(1.0)  # 100 busy seconds at $36/h
    assert (current.checkpoint_id, current.ended_at, current.prompt_tokens) == (second, None, 0)

    deploy(activities, name, second)  # a retried or no-op deploy: the same tenure, no new row
    assert len(tenures(session_factory, loop_id)) == 2


def test_a_server_restart_counts_from_zero_never_negative(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "first", 0)
    second = add_checkpoint(session_factory, loop_id, "second", 1)
    counters.now = {first: VersionUsage(500, 100, 200, 50.0)}
    deploy(activities, name, first)
    counters.now = {first: VersionUsage(30, 0, 20, 2.0)}  # restarted, then served a little
    deploy(activities, name, second)

    ended, _ = tenures(session_factory, loop_id)
    assert (ended.prompt_tokens, ended.completion_tokens) == (30, 20)
    assert ended.busy_seconds == pytest.approx(2.0)


def test_an_unreadable_server_never_fails_a_deploy(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "first", 0)
    second = add_checkpoint(session_factory, loop_id, "second", 1)
    counters.down = True
    deploy(activities, name, first)
    counters.down = False
    counters.now = {first: VersionUsage(100, 0, 50, 10.0)}
    deploy(activities, name, second)  # the first sample after the outage sets the baseline

    ended, current = tenures(session_factory, loop_id)
    assert (ended.checkpoint_id, ended.prompt_tokens, ended.ended_at is not None) == (
        first,
        0,
        True,
    )
    assert current.checkpoint_id == second


def test_champion_figures_price_tokens_and_the_break_even(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    """Both figures per champion: $/Mtok served (blended, and cached tokens priced apart),
    live success, held-out pass rate, the producing cycle's $ per point, the break-even."""
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "first", 0)
    second = add_checkpoint(session_factory, loop_id, "second", 1)
    with session_factory.begin() as session:
        cycle = Cycle(
            loop_id=loop_id,
            number=1,
            trigger="operator",
            stage="done",
            champion_checkpoint_id=first,
            candidate_checkpoint_id=second,
            cost_usd=4,
            points_gained=8.0,
            ended_at=dt.datetime.now(dt.UTC),
            outcome="promoted",
        )
        session.add(cycle)
        session.flush()
        session.add(
            Evaluation(
                loop_id=loop_id,
                cycle_id=cycle.id,
                checkpoint_id=second,
                task_set="heldout",
                n=10,
                passed=7,
                pass_rate=0.7,
                ci_low=0.4,
                ci_high=0.9,
            )
        )
    deploy(activities, name, first)
    _traces(session_factory, loop_id, first, successes=5, failures=5)
    counters.now = {first: VersionUsage(0, 0, 0, 0.0)}
    deploy(activities, name, second)
    _traces(session_factory, loop_id, second, successes=9, failures=1)
    counters.now = {
        first: VersionUsage(0, 0, 0, 0.0),
        second: VersionUsage(600_000, 500_000, 400_000, 360.0),
    }
    deploy(activities, name, second)  # a sample of the open tenure

    with session_factory() as session:
        loop = session.get_one(Loop, loop_id)
        old, new = champion_figures(
            session=session, loop=loop, cached_token_weight=0.1, value_per_success_usd=0.5
        )
        totals = serving_totals(session=session, loop=loop)
    assert (totals.tokens, totals.cost_usd) == (1_000_000, pytest.approx(3.6))
    assert (old.checkpoint_id, old.tokens_served, old.usd_per_mtok) == (first, 0, None)
    assert old.live_success_rate == pytest.approx(0.5)
    assert new.tokens_served == 1_000_000
    assert new.serving_cost_usd == pytest.approx(3.6)
    assert new.usd_per_mtok == pytest.approx(3.6)
    # computed tokens: 100k prompt + 400k completion; cached: 500k at a tenth of the price
    computed, cached = new.usd_per_mtok_computed, new.usd_per_mtok_cached
    assert computed is not None and cached is not None
    assert computed == pytest.approx(3.6 / 550_000 * 1e6)
    assert cached == pytest.approx(computed * 0.1)
    assert (new.live_episodes, new.live_success_rate) == (10, pytest.approx(0.9))
    assert new.heldout_pass_rate == pytest.approx(0.7)
    assert (new.cycle, new.cycle_cost_usd, new.usd_per_heldout_point) == (1, 4.0, 0.5)
    # $4 repaid at +0.4 successes per episode worth $0.5: 20 episodes of 100k tokens
    assert new.break_even_tokens == pytest.approx(2_000_000)


def _traces(
    session_factory: SessionFactory, loop_id: int, version: str, *, successes: int, failures: int
) -> None:
    with session_factory.begin() as session:
        for index in range(successes + failures):
            session.add(
                Trace(
                    loop_id=loop_id,
                    external_id=f"{version}-{index}",
                    model_version=version,
                    success=index < successes,
                    body={},
                    size_bytes=2,
                )
            )


def test_each_cycle_close_samples_the_champion_serving_now(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    """A loop whose champion was set before the ledger began gets its tenure at the first
    close; every close after adds what it served since."""
    loop_id, name = make_loop(session_factory)
    champion = add_checkpoint(session_factory, loop_id, "champion", 0)
    set_champion(session_factory, loop_id, champion)
    for number in (1, 2):
        add_cycle(session_factory, loop_id, number, champion=champion, candidate=None, ended=False)
        counters.now = {champion: VersionUsage(100 * number, 0, 10 * number, 1.0 * number)}
        activities.cycle.close_cycle(CloseCycleInput(name, number, "rejected", "no win"))

    (tenure,) = tenures(session_factory, loop_id)
    assert (tenure.checkpoint_id, tenure.ended_at) == (champion, None)
    assert (tenure.prompt_tokens, tenure.completion_tokens) == (100, 10)
    assert tenure.busy_seconds == pytest.approx(1.0)


def test_the_scheduled_sample_keeps_the_serving_champion_fresh_between_deploys(
    session_factory: SessionFactory, activities: StageActivities, counters: Counters
) -> None:
    """Between deploys the schedule's sample adds the growth to the open tenure (and a
    retried sample adds nothing); an archived loop is not asked; a server that cannot be
    read is counted, not raised."""
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "first", 0)
    counters.now = {first: VersionUsage(100, 0, 50, 10.0)}
    deploy(activities, name, first)
    counters.now = {first: VersionUsage(400, 100, 250, 40.0)}
    sampled = activities.ledger.sample_serving_ledgers(ServingLedgerInput())
    assert sampled.sampled >= 1 and sampled.unreadable == 0
    activities.ledger.sample_serving_ledgers(ServingLedgerInput())  # a retry: nothing more
    (tenure,) = tenures(session_factory, loop_id)
    assert tenure.ended_at is None
    assert (tenure.prompt_tokens, tenure.cached_prompt_tokens, tenure.completion_tokens) == (
        300,
        100,
        200,
    )
    assert tenure.busy_seconds == pytest.approx(30.0)

    with session_factory.begin() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        loop.status = "archived"
    counters.now = {first: VersionUsage(900, 100, 450, 90.0)}
    activities.ledger.sample_serving_ledgers(ServingLedgerInput())
    (tenure,) = tenures(session_factory, loop_id)
    assert tenure.prompt_tokens == 300  # an archived loop's server is not asked

    with session_factory.begin() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        loop.status = "paused"  # a paused loop's champion still serves
    counters.down = True
    assert activities.ledger.sample_serving_ledgers(ServingLedgerInput()).unreadable >= 1
    (tenure,) = tenures(session_factory, loop_id)
    assert tenure.prompt_tokens == 300 and tenure.ended_at is None


async def test_the_ledger_schedule_follows_the_setting(
    temporal_client: Client, task_queue: str
) -> None:
    handle = temporal_client.get_schedule_handle(SERVING_LEDGER_SCHEDULE_ID)
    try:
        await ensure_serving_ledger_schedule(temporal_client, 300, task_queue)
        await ensure_serving_ledger_schedule(temporal_client, 60, task_queue)  # updated
        described = await handle.describe()
        assert described.schedule.action.workflow == "ServingLedgerWorkflow"  # type: ignore[attr-defined]
        assert described.schedule.spec.intervals[0].every == dt.timedelta(seconds=60)
        await ensure_serving_ledger_schedule(temporal_client, 0, task_queue)  # off: deleted
        with pytest.raises(RPCError):
            await handle.describe()
        await ensure_serving_ledger_schedule(temporal_client, 0, task_queue)  # idempotent
    finally:
        with contextlib.suppress(RPCError):
            await handle.delete()

"""The loop's activities against a real Postgres: live counts, rollback, the deploy guard, the
cycle number a restarted loop continues from, and the three numbers a cycle records.

The serving target is the one dependency replaced: a recorder that answers with the version
it was asked to deploy, as every real target does once the deploy is verified.
"""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
from sqlalchemy import select
from temporalio.exceptions import ApplicationError

from services.db.models import Checkpoint, Cycle, Loop, Promotion, Trace
from services.db.session import SessionFactory
from services.loop.policies import ServingTarget
from services.modelserver.attestation import attested, response_id
from services.serving.base import DeployFailed
from workflows.activities.stages import StageActivities
from workflows.payloads.cycle import CloseCycleInput, StartCycleInput
from workflows.payloads.loop import LoopConfigInput
from workflows.payloads.promote import DeployInput, LiveStats, LiveStatsInput
from workflows.payloads.rollback import FinishRollbackInput, RollbackInput

T0 = dt.datetime(2026, 12, 1, 8, 0, tzinfo=dt.UTC)
_ids = itertools.count()


@dataclass
class RecordingTarget:
    """A serving target that serves whatever it was last asked to."""

    deployed: list[str] = field(default_factory=list)

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, checkpoint_uri: str
    ) -> str:
        self.deployed.append(checkpoint_id)
        return checkpoint_id


def add_checkpoint(session_factory: SessionFactory, loop_id: int, name: str, minutes: int) -> str:
    with session_factory.begin() as session:
        session.add(
            Checkpoint(
                id=name,
                loop_id=loop_id,
                uri=f"file:///artifacts/{name}",
                format="ratchet.tiny/v1",
                size_bytes=1,
                sha256="0" * 64,
                manifest={},
                created_at=T0 + dt.timedelta(minutes=minutes),
            )
        )
    return name


def make_loop(session_factory: SessionFactory) -> tuple[int, str]:
    """A new loop: its id and its name."""
    with session_factory.begin() as session:
        loop = Loop(name=f"bot-{next(_ids)}", environment="toolcalc")
        session.add(loop)
        session.flush()
        return loop.id, loop.name


def loop_row(session_factory: SessionFactory, loop_id: int) -> Loop:
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        return loop


def set_champion(session_factory: SessionFactory, loop_id: int, checkpoint_id: str) -> None:
    with session_factory.begin() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        loop.champion_checkpoint_id = checkpoint_id


def add_cycle(
    session_factory: SessionFactory,
    loop_id: int,
    number: int,
    *,
    champion: str,
    candidate: str | None,
    ended: bool = True,
) -> int:
    with session_factory.begin() as session:
        cycle = Cycle(
            loop_id=loop_id,
            number=number,
            trigger="operator",
            stage="done" if ended else "promote",
            champion_checkpoint_id=champion,
            candidate_checkpoint_id=candidate,
            ended_at=T0 if ended else None,
            outcome="promoted" if ended else None,
        )
        session.add(cycle)
        session.flush()
        return cycle.id


def add_held_promotion(
    session_factory: SessionFactory,
    cycle_id: int,
    *,
    candidate: str,
    previous: str,
    statistics: dict[str, Any] | None = None,
) -> None:
    """A cycle's promotion whose canary held: the state a rollback or a close starts from."""
    with session_factory.begin() as session:
        cycle = session.get_one(Cycle, cycle_id)
        session.add(
            Promotion(
                loop_id=cycle.loop_id,
                cycle_id=cycle_id,
                decision="promote",
                status="held",
                reason="significant win",
                statistics=statistics or {},
                candidate_checkpoint_id=candidate,
                previous_checkpoint_id=previous,
            )
        )


def add_traces(
    session_factory: SessionFactory,
    loop_id: int,
    version: str,
    outcomes: list[bool],
    *,
    start_minute: int,
) -> None:
    with session_factory.begin() as session:
        for index, success in enumerate(outcomes):
            session.add(
                Trace(
                    loop_id=loop_id,
                    external_id=f"{version}-{start_minute}-{index}-{next(_ids)}",
                    model_version=version,
                    success=success,
                    body={},
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(minutes=start_minute, seconds=index),
                )
            )


@pytest.fixture
def target() -> RecordingTarget:
    return RecordingTarget()


@pytest.fixture
def activities(session_factory: SessionFactory, target: RecordingTarget) -> StageActivities:
    return StageActivities.build(session_factory, target)


# live_counts through the canary's activity -------------------------------------------------


def test_live_stats_counts_a_versions_newest_traces_in_the_window(
    session_factory: SessionFactory, activities: StageActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    add_traces(session_factory, loop_id, "v-old", [True] * 30 + [False] * 10, start_minute=0)
    add_traces(session_factory, loop_id, "v-new", [False] * 5 + [True] * 15, start_minute=10)
    add_traces(session_factory, loop_id, "v-other", [False] * 50, start_minute=10)
    deployed_at = (T0 + dt.timedelta(minutes=10)).isoformat()

    before = activities.canary.live_stats(LiveStatsInput(name, "v-old", until=deployed_at))
    assert (before.n, before.successes, before.success_rate) == (40, 30, 0.75)
    assert before.ci_low is not None and before.ci_high is not None
    assert before.ci_low < 0.75 < before.ci_high

    after = activities.canary.live_stats(LiveStatsInput(name, "v-new", since=deployed_at))
    assert (after.n, after.successes) == (20, 15)
    # The newest ``limit`` traces only: the 10 newest of v-new are all successes.
    newest = activities.canary.live_stats(
        LiveStatsInput(name, "v-new", since=deployed_at, limit=10)
    )
    assert (newest.n, newest.successes) == (10, 10)
    # Traces of other versions never count, and a version without traces has no rate.
    none = activities.canary.live_stats(LiveStatsInput(name, "v-missing"))
    assert (none.n, none.success_rate) == (0, None)
    # Before the window opens the new version has no traces.
    assert activities.canary.live_stats(LiveStatsInput(name, "v-new", until=deployed_at)).n == 0


def test_where_the_server_signs_the_canary_counts_only_the_traces_it_served(
    session_factory: SessionFactory, target: RecordingTarget
) -> None:
    """A client that claims the new version for failures it got elsewhere (or sends no ids)
    no longer moves the canary: only traces whose response ids the server signed for the
    version they claim are counted (issue 28)."""
    key = b"k" * 32
    activities = StageActivities.build(
        session_factory, target, attestation=lambda _target: partial(attested, key=key)
    )
    loop_id, name = make_loop(session_factory)
    with session_factory.begin() as session:
        for index, (ids, success) in enumerate(
            [
                ([response_id("chatcmpl", "v-new", key)], True),
                ([response_id("chatcmpl", "v-new", key)] * 2, True),
                ([response_id("chatcmpl", "v-old", key)], False),  # served by the old one
                ([], False),  # the client's word only
                (["chatcmpl-made-up"], False),
            ]
        ):
            session.add(
                Trace(
                    loop_id=loop_id,
                    external_id=f"signed-{index}",
                    model_version="v-new",
                    success=success,
                    body={"response_ids": ids},
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(seconds=index),
                )
            )
    stats = activities.canary.live_stats(LiveStatsInput(name, "v-new"))
    assert (stats.n, stats.successes, stats.unattested) == (2, 2, 3)
    trusting = StageActivities.build(session_factory, target).canary.live_stats(
        LiveStatsInput(name, "v-new")
    )
    assert (trusting.n, trusting.successes) == (5, 2)


# rollback_champion ---------------------------------------------------------------------


def test_rollback_champion_serves_the_previous_champion_again_once(
    session_factory: SessionFactory, activities: StageActivities, target: RecordingTarget
) -> None:
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, "ckpt-first", 0)
    second = add_checkpoint(session_factory, loop_id, "ckpt-second", 5)
    cycle_id = add_cycle(session_factory, loop_id, 1, champion=first, candidate=second)
    set_champion(session_factory, loop_id, second)
    add_held_promotion(session_factory, cycle_id, candidate=second, previous=first)

    result = activities.deploy.rollback_champion(RollbackInput(name, "live complaints"))
    assert (result.rolled_back, result.checkpoint_id) == (True, first)
    assert target.deployed == [first]
    assert loop_row(session_factory, loop_id).champion_checkpoint_id == first
    with session_factory() as session:
        rows = session.scalars(
            select(Promotion).where(Promotion.loop_id == loop_id).order_by(Promotion.id)
        ).all()
        assert [(p.decision, p.status) for p in rows] == [
            ("promote", "rolled_back"),
            ("rollback", "rolled_back"),
        ]
        assert rows[0].rolled_back_at is not None
        assert (rows[1].candidate_checkpoint_id, rows[1].previous_checkpoint_id) == (first, second)

    # A retry (or a second request) finds nothing left to undo and deploys nothing.
    again = activities.deploy.rollback_champion(RollbackInput(name, "live complaints"))
    assert (again.rolled_back, again.reason) == (False, "no promotion to roll back")
    assert target.deployed == [first]


def test_rollback_without_a_held_promotion_changes_nothing(
    session_factory: SessionFactory, activities: StageActivities, target: RecordingTarget
) -> None:
    loop_id, name = make_loop(session_factory)
    set_champion(session_factory, loop_id, add_checkpoint(session_factory, loop_id, "only", 0))
    result = activities.deploy.rollback_champion(RollbackInput(name, "why not"))
    assert not result.rolled_back
    assert target.deployed == []
    assert loop_row(session_factory, loop_id).champion_checkpoint_id == "only"


def _rolled_back_setup(session_factory: SessionFactory) -> tuple[int, str, str, str]:
    loop_id, name = make_loop(session_factory)
    first = add_checkpoint(session_factory, loop_id, f"ckpt-first-{loop_id}", 0)
    second = add_checkpoint(session_factory, loop_id, f"ckpt-second-{loop_id}", 5)
    cycle_id = add_cycle(session_factory, loop_id, 1, champion=first, candidate=second)
    set_champion(session_factory, loop_id, second)
    add_held_promotion(session_factory, cycle_id, candidate=second, previous=first)
    return loop_id, name, first, second


def test_the_rollback_deploy_holds_no_lock_on_the_loop(session_factory: SessionFactory) -> None:
    """A rollout takes minutes: the loop's row must stay writable meanwhile (pause, a config
    change, the dashboard's actions all lock it)."""
    loop_id, name, first, _ = _rolled_back_setup(session_factory)
    seen: list[str] = []

    def deploy(serving_target: dict[str, Any], checkpoint_id: str, checkpoint_uri: str) -> str:
        with session_factory.begin() as other:
            locked = other.execute(
                select(Loop.id).where(Loop.id == loop_id).with_for_update(nowait=True)
            ).scalar_one()
            assert locked == loop_id
        seen.append(checkpoint_id)
        return checkpoint_id

    result = StageActivities.build(session_factory, deploy).deploy.rollback_champion(
        RollbackInput(name, "live complaints")
    )
    assert seen == [first]
    assert (result.rolled_back, result.checkpoint_id) == (True, first)


def test_a_failed_rollback_deploy_is_recorded_and_changes_nothing_else(
    session_factory: SessionFactory,
) -> None:
    loop_id, name, first, second = _rolled_back_setup(session_factory)

    def deploy(serving_target: dict[str, Any], checkpoint_id: str, checkpoint_uri: str) -> str:
        raise DeployFailed("the model server refused the adapter")

    activities = StageActivities.build(session_factory, deploy)
    result = activities.deploy.rollback_champion(RollbackInput(name, "live complaints"))
    assert not result.rolled_back
    assert "failed" in result.reason and "refused the adapter" in result.reason
    assert loop_row(session_factory, loop_id).champion_checkpoint_id == second

    def rows() -> list[tuple[str, str, str | None, str]]:
        with session_factory() as session:
            return [
                (p.decision, p.status, p.candidate_checkpoint_id, p.reason)
                for p in session.scalars(
                    select(Promotion).where(Promotion.loop_id == loop_id).order_by(Promotion.id)
                )
            ]

    recorded = rows()
    assert [(d, s, c) for d, s, c, _ in recorded] == [
        ("promote", "held", second),
        ("rollback", "failed", first),
    ]
    assert "refused the adapter" in recorded[1][3]
    # Recording the same outcome again (a retried activity) adds nothing.
    plan = activities.deploy.plan_rollback(RollbackInput(name, "live complaints"))
    assert (plan.promotion_id is not None, plan.checkpoint_id) == (True, first)
    assert plan.promotion_id is not None
    error = "the model server refused the adapter"
    finish = FinishRollbackInput(name, "again", plan.promotion_id, first, error)
    activities.deploy.finish_rollback(finish)
    activities.deploy.finish_rollback(finish)
    assert len(rows()) == 3


# A restarted loop never replays an old cycle (issue 15, item 3) ----------------------------


def test_loop_config_names_the_last_cycle_postgres_knows(
    session_factory: SessionFactory, activities: StageActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    assert activities.cycle.load_loop_config(LoopConfigInput(name)).last_cycle_number == 0
    champion = add_checkpoint(session_factory, loop_id, "c0", 0)
    for number in (1, 2, 3):
        add_cycle(session_factory, loop_id, number, champion=champion, candidate=None)
    config = activities.cycle.load_loop_config(LoopConfigInput(name))
    assert config.last_cycle_number == 3
    assert config.gate_policy.eval_samples > 1 and config.gate_policy.eval_temperature > 0
    assert config.gate_policy.min_discordant_pairs >= 1


def test_a_promotion_never_deploys_an_old_cycles_candidate(
    session_factory: SessionFactory, activities: StageActivities, target: RecordingTarget
) -> None:
    """Cycle 1's candidate was promoted long ago; a later champion serves now. A loop whose
    workflow chain restarted at cycle 1 gets cycle 1's records back from the idempotent
    activities: its PromoteWorkflow must not put that old candidate over the champion."""
    loop_id, name = make_loop(session_factory)
    base = add_checkpoint(session_factory, loop_id, "base", 0)
    old = add_checkpoint(session_factory, loop_id, "cycle-1-candidate", 10)
    newer = add_checkpoint(session_factory, loop_id, "cycle-2-candidate", 20)
    add_cycle(session_factory, loop_id, 1, champion=base, candidate=old)
    add_cycle(session_factory, loop_id, 2, champion=old, candidate=newer)
    set_champion(session_factory, loop_id, newer)

    def deploy(checkpoint: str, cycle: int, purpose: str = "candidate") -> None:
        activities.deploy.deploy_checkpoint(
            DeployInput(
                name,
                ServingTarget(kind="local"),
                checkpoint,
                f"file:///{checkpoint}",
                cycle,
                purpose,
            )
        )

    for checkpoint, cycle, why in [
        (old, 1, "not the loop's newest cycle"),
        (base, 2, "is not cycle 2's candidate"),
        (old, 2, "is not cycle 2's candidate"),
    ]:
        with pytest.raises(ApplicationError, match=why) as refused:
            deploy(checkpoint, cycle)
        assert refused.value.non_retryable
    # Restoring anything but the champion is refused too.
    with pytest.raises(ApplicationError, match="but the champion is"):
        deploy(old, 2, "restore")
    assert target.deployed == []

    # The newest cycle's own candidate, trained from the champion, deploys.
    latest = add_checkpoint(session_factory, loop_id, "cycle-3-candidate", 30)
    add_cycle(session_factory, loop_id, 3, champion=newer, candidate=latest, ended=False)
    deploy(latest, 3)
    deploy(newer, 3, "restore")
    assert target.deployed == [latest, newer]


def test_a_candidate_older_than_the_champion_is_refused(
    session_factory: SessionFactory, activities: StageActivities, target: RecordingTarget
) -> None:
    loop_id, name = make_loop(session_factory)
    stale = add_checkpoint(session_factory, loop_id, "stale", 0)
    champion = add_checkpoint(session_factory, loop_id, "champion", 10)
    set_champion(session_factory, loop_id, champion)
    add_cycle(session_factory, loop_id, 1, champion=champion, candidate=stale, ended=False)
    with pytest.raises(ApplicationError, match="older than the champion"):
        activities.deploy.deploy_checkpoint(
            DeployInput(name, ServingTarget(kind="local"), stale, "file:///stale", cycle=1)
        )
    assert target.deployed == []


def test_start_cycle_with_the_number_after_postgres_opens_a_new_cycle(
    session_factory: SessionFactory, activities: StageActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    champion = add_checkpoint(session_factory, loop_id, "c0", 0)
    set_champion(session_factory, loop_id, champion)
    add_cycle(session_factory, loop_id, 1, champion=champion, candidate=None)
    last = activities.cycle.load_loop_config(LoopConfigInput(name)).last_cycle_number
    started = activities.cycle.start_cycle(
        StartCycleInput(name, last + 1, "operator", {}, f"loop/{name}")
    )
    with session_factory() as session:
        numbers = session.scalars(
            select(Cycle.number).where(Cycle.loop_id == loop_id).order_by(Cycle.number)
        ).all()
        opened = session.get(Cycle, started.cycle_id)
    assert list(numbers) == [1, 2]
    assert opened is not None and opened.number == 2 and opened.ended_at is None


# The three numbers ---------------------------------------------------------------------


def test_close_cycle_records_heldout_gate_and_live_points_with_intervals(
    session_factory: SessionFactory, activities: StageActivities
) -> None:
    loop_id, name = make_loop(session_factory)
    champion = add_checkpoint(session_factory, loop_id, "c0", 0)
    candidate = add_checkpoint(session_factory, loop_id, "c1", 5)
    cycle_id = add_cycle(
        session_factory, loop_id, 1, champion=champion, candidate=candidate, ended=False
    )
    statistics = {
        "delta_points": 60.0,
        "eval": {"delta": 0.6, "ci_low": 0.4, "ci_high": 0.8, "n": 20},
        "heldout": {"delta": 0.05, "ci_low": -0.02, "ci_high": 0.12, "n": 40},
        "heldout_points": 5.0,
    }
    add_held_promotion(
        session_factory, cycle_id, candidate=candidate, previous=champion, statistics=statistics
    )
    closed = activities.cycle.close_cycle(
        CloseCycleInput(
            name,
            1,
            "promoted",
            "win",
            points_gained=5.0,
            candidate_checkpoint_id=candidate,
            gate_points=60.0,
            live_baseline=LiveStats(100, 40, 0.4),
            live_canary=LiveStats(50, 35, 0.7),
        )
    )
    assert closed.cumulative_points == 5.0
    with session_factory() as session:
        cycle = session.get(Cycle, cycle_id)
        assert cycle is not None
        assert (cycle.points_gained, cycle.gate_points) == (5.0, 60.0)
        assert cycle.live_points == pytest.approx(30.0)
        detail = cycle.points_detail
    assert detail["heldout"]["points"] == pytest.approx(5.0)
    assert detail["heldout"]["ci_low_points"] == pytest.approx(-2.0)
    assert detail["gate"]["ci_high_points"] == pytest.approx(80.0)
    live = detail["live"]
    assert (live["n_before"], live["successes_after"]) == (100, 35)
    assert live["ci_low_points"] < 30.0 < live["ci_high_points"]


def test_the_stages_register_the_names_committed_histories_use(
    activities: StageActivities,
) -> None:
    """Split by stage, the activities keep their registered names: replayed histories and
    running workflows name them."""
    names = [defn.__temporal_activity_definition.name for defn in activities.activities()]
    assert sorted(names) == sorted(
        [
            "load_loop_config",
            "start_cycle",
            "set_cycle_stage",
            "close_cycle",
            "record_evaluation",
            "gate",
            "record_decision",
            "deploy_checkpoint",
            "rollback_champion",
            "plan_rollback",
            "finish_rollback",
            "live_stats",
            "update_promotion",
            "sample_serving_ledgers",
        ]
    )


def test_no_deploy_holds_the_loops_row_lock(session_factory: SessionFactory) -> None:
    """While the serving target deploys (minutes, in a cluster), another writer can lock the
    loop's row at once: the candidate check committed before the deploy began."""
    loop_id, name = make_loop(session_factory)
    champion = add_checkpoint(session_factory, loop_id, "champion", 0)
    candidate = add_checkpoint(session_factory, loop_id, "candidate", 10)
    set_champion(session_factory, loop_id, champion)
    add_cycle(session_factory, loop_id, 1, champion=champion, candidate=candidate, ended=False)
    locked_during_deploy: list[bool] = []

    def deploy(serving_target: dict[str, Any], checkpoint_id: str, uri: str) -> str:
        with session_factory.begin() as other:
            row = other.execute(
                select(Loop.id).where(Loop.id == loop_id).with_for_update(nowait=True)
            ).scalar_one()
            locked_during_deploy.append(row == loop_id)
        return checkpoint_id

    stages = StageActivities.build(session_factory, deploy)
    result = stages.deploy.deploy_checkpoint(
        DeployInput(name, ServingTarget(kind="local"), candidate, "file:///candidate", cycle=1)
    )
    assert result.served_version == candidate and locked_during_deploy == [True]

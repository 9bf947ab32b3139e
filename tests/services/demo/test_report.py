"""The demo's report reads live success from Postgres through the canary's own query."""

from __future__ import annotations

import datetime as dt
from functools import partial
from pathlib import Path

from sqlalchemy import select

from services.db.models import Checkpoint, Cycle, Evaluation, Loop, Promotion, Run, Trace
from services.db.queries.promotions import loop_promotions
from services.db.session import SessionFactory
from services.demo.champion import champion_note
from services.demo.options import DemoOptions
from services.demo.report import DemoReport, build_report, format_report, live_before_after
from services.evaluation.figures import live_gain, rate
from services.modelserver.attestation import attested, response_id
from tests.services.dashboard.seed import seed_story

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)


def _seed(session_factory: SessionFactory) -> tuple[int, int]:
    with session_factory.begin() as session:
        loop = Loop(name="demo", environment="toolcalc")
        session.add(loop)
        session.flush()
        for name in ("old", "new"):
            session.add(
                Checkpoint(
                    id=name,
                    loop_id=loop.id,
                    uri=f"file:///{name}",
                    format="ratchet.tiny/v1",
                    size_bytes=1,
                    sha256="0" * 64,
                    manifest={},
                )
            )
        session.flush()
        # Before the drift (minute 0-9): the old model does well and is not counted.
        # After it (10-19): the old model fails 3 in 4. After the deploy (20-): 9 in 10 pass.
        outcomes = [("old", m, True) for m in range(10)]
        outcomes += [("old", 10 + m, m % 4 == 0) for m in range(8)]
        outcomes += [("new", 20 + m, m != 0) for m in range(10)]
        for index, (version, minute, success) in enumerate(outcomes):
            session.add(
                Trace(
                    loop_id=loop.id,
                    external_id=f"t{index}",
                    model_version=version,
                    success=success,
                    body={},
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(minutes=minute),
                )
            )
        promotion = Promotion(
            loop_id=loop.id,
            decision="promote",
            status="held",
            reason="win",
            candidate_checkpoint_id="new",
            previous_checkpoint_id="old",
            deployed_at=T0 + dt.timedelta(minutes=20),
        )
        session.add(promotion)
        session.flush()
        return loop.id, promotion.id


def test_live_success_before_and_after_come_from_the_stored_traces(
    session_factory: SessionFactory,
) -> None:
    loop_id, promotion_id = _seed(session_factory)
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        (promotion,) = loop_promotions(session=session, loop_id=loop_id)
        assert promotion.id == promotion_id
        measured = live_before_after(session, loop, [promotion], T0 + dt.timedelta(minutes=10))
        assert measured.before == 2 / 8
        assert measured.after == 9 / 10
        # with their counts and intervals
        assert measured.before_figure == rate(2, 8) and measured.after_figure == rate(9, 10)
        assert measured.delta == live_gain((2, 8), (9, 10))
        # Without a drift there is no "before" to speak of.
        assert live_before_after(session, loop, [promotion], None).before is None


def test_every_report_says_how_the_toy_champion_was_made() -> None:
    assert "pre-exposed to v2's names: 30%" in champion_note(DemoOptions())
    plain = DemoOptions(sft_hyperparameters={"steps": 10})
    assert "not exposed to v2's names" in champion_note(plain)
    real = champion_note(DemoOptions(model="smollm2"))
    assert "SmolLM2-135M-Instruct" in real and "pre-exposed" not in real
    # what the champion saw: v1 only, about half of it recovering from a usage error
    assert "about half first make a call without its last argument" in real
    assert "usage error, and make it right" in real and " only" not in real


def story_report(session_factory: SessionFactory, tmp_path: Path) -> DemoReport:
    """The dashboard's seeded story (two cycles), with held-out evaluations for the promoted
    one and a rare-successes sentence on its train run, reported."""
    now = dt.datetime.now(dt.UTC)
    with session_factory.begin() as session:
        seed_story(session, now=now, artifacts_dir=tmp_path, name="demo")
        promoted = session.scalars(select(Cycle).where(Cycle.outcome == "promoted")).one()
        eval_row = session.scalars(
            select(Evaluation).where(Evaluation.cycle_id == promoted.id)
        ).first()
        assert eval_row is not None
        for checkpoint_id, passed in (
            (promoted.champion_checkpoint_id, 10),
            (promoted.candidate_checkpoint_id, 30),
        ):
            assert checkpoint_id is not None
            session.add(
                Evaluation(
                    loop_id=promoted.loop_id,
                    cycle_id=promoted.id,
                    checkpoint_id=checkpoint_id,
                    dataset_id=eval_row.dataset_id,
                    run_id=eval_row.run_id,
                    task_set="heldout",
                    n=40,
                    passed=passed,
                    pass_rate=passed / 40,
                    ci_low=passed / 40 - 0.1,
                    ci_high=passed / 40 + 0.1,
                )
            )
        # cycle 2's train job found its successes rare, and said so in its metrics
        train_run = session.get_one(Run, "demo-c2-train")
        train_run.metrics = {**train_run.metrics, "rare_successes": "round 1: 1 of 1,024"}
    with session_factory() as session:
        loop = session.scalars(select(Loop).where(Loop.name == "demo")).one()
        return build_report(
            session,
            loop=loop,
            live=[(1.0, 0.5, 10, "v1")],
            drift_at=5.0,
            drift_wall=None,
            traces_posted=7,
            state_dir=str(tmp_path),
        )


def test_the_report_reads_the_dashboards_cycles(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """Every row comes from the stored cycles, evaluations, runs and promotions."""
    report = story_report(session_factory, tmp_path)
    first, second = report.cycles
    assert (first.number, first.outcome, first.decision) == (1, "rolled_back", "promote")
    assert (second.number, second.outcome, second.trigger) == (2, "promoted", "drift")
    assert first.reason == "live success fell from 40% to 25%"
    assert (first.cost_usd, second.cost_usd) == (1.4, 2.1)
    assert (second.points, second.gate_points, second.live_points) == (58.3, 91.7, 41.0)
    assert (second.train_tasks, second.eval_tasks) == (20, 12)
    assert second.champion_pass is not None and round(second.champion_pass[0], 2) == 0.25
    assert second.heldout_champion_pass == (0.25, 0.15, 0.35)
    assert second.heldout_candidate_pass == (0.75, 0.65, 0.85)
    assert first.heldout_candidate_pass is None
    assert 0 < first.job_s <= first.wall_s and first.train_s > 0
    assert report.canary_window_s == first.waiting_s + second.waiting_s == 4 * 3600
    assert report.promotions == 1 and report.traces_posted == 7
    assert report.heldout_points_gained == 58.3
    text = format_report(report)
    assert "held-out pass@1: champion 25% [15,35], candidate 75% [65,85]" in text
    assert "canary windows: 14400s" in text
    # the estimate beside the actual, and where the money went (the seeded cycle 2)
    assert (first.estimate_usd, second.estimate_usd) == (None, 2.0)
    assert second.cost_by_phase == {"rollout": 1.2, "update": 0.3, "evaluation": 0.6}
    assert report.estimate_usd == 2.0 and report.actual_usd == 3.5
    assert report.cost_by_phase == second.cost_by_phase
    assert report.cycle_wall_s == round((first.wall_s + second.wall_s) / 2, 1)
    assert "cost by phase: rollout $1.2000 · update $0.3000 · evaluation $0.6000" in text
    assert "estimate: $2.0000   actual: $3.5000" in text
    figures = report.to_json()
    assert {"estimate_usd", "actual_usd", "cost_by_phase", "cycle_wall_s"} <= set(figures)


def test_the_report_gives_every_number_its_interval_and_counts(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    report = story_report(session_factory, tmp_path)
    first, second = report.cycles
    text, figures = format_report(report), report.to_json()
    assert second.heldout is not None and second.live_delta is not None
    assert (second.heldout.n, second.heldout.low, second.heldout.high) == (40, 40.1, 72.4)
    assert (second.live_delta.n_before, second.live_delta.n) == (40, 60)
    assert (
        "measured: held-out +58.3 [+40.1, +72.4] pts (40 tasks) · gate +91.7 [+75.0, +100.0] "
        "pts (12 tasks) · live +41.0 [+22.5, +55.2] pts (40 → 60 traces)"
    ) in text
    assert report.heldout_gain == second.heldout
    assert "held-out points gained: +58.3 [+40.1, +72.4] pts (40 tasks)" in text
    # ±16.2 points on 40 tasks: the report says the set is too small for ±15; and rare
    # successes in training, where they were
    assert report.notes == [
        "the held-out interval is ±16.2 points on 40 tasks: wider than ±15, so the set is "
        "too small to tell a gain under that from noise",
        "cycle 2's training: round 1: 1 of 1,024",
    ]
    assert second.rare_successes == "round 1: 1 of 1,024" and first.rare_successes is None
    assert f"NOTE: {report.notes[0]}" in text
    assert figures["heldout_gain"]["n"] == 40 and figures["cycles"][1]["gate"]["n"] == 12


def test_live_success_counts_what_the_server_signed_as_the_canary_does(
    session_factory: SessionFactory,
) -> None:
    """An episode the server answered with two versions (it straddled the deploy, and the
    agent reports the last version) counts for neither, as in the canary: with the
    attestation key, the report's after-promotion figure is the new version's own."""
    key = b"demo-attestation-key"
    loop_id, _ = _seed(session_factory)
    with session_factory.begin() as session:
        for trace in session.scalars(select(Trace).where(Trace.loop_id == loop_id)):
            trace.body = {"response_ids": [response_id("chatcmpl", trace.model_version, key)]}
        # two episodes that began on the old version and ended on the new one, both failed
        for index in range(2):
            session.add(
                Trace(
                    loop_id=loop_id,
                    external_id=f"straddled-{index}",
                    model_version="new",
                    success=False,
                    body={
                        "response_ids": [
                            response_id("chatcmpl", "old", key),
                            response_id("chatcmpl", "new", key),
                        ]
                    },
                    size_bytes=2,
                    received_at=T0 + dt.timedelta(minutes=21),
                )
            )
    with session_factory() as session:
        loop = session.get(Loop, loop_id)
        assert loop is not None
        (promotion,) = loop_promotions(session=session, loop_id=loop_id)
        drift = T0 + dt.timedelta(minutes=10)
        claimed = live_before_after(session, loop, [promotion], drift)
        served = live_before_after(
            session, loop, [promotion], drift, attested=partial(attested, key=key)
        )
    assert claimed.after_counts == (9, 12)  # the client's word: the straddlers count
    assert served.after_counts == (9, 10) and served.before_counts == (2, 8)

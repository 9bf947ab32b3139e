"""The closed loop, end to end (issue 16): every part real.

The embedded Postgres and Temporal dev server, ``ratchet api``, ``ratchet worker``, the local
executor's jobs and ``ratchet serve`` all run as processes. Production is the demo's traffic
simulator: an agent asks the served model through the model server, runs the tools and posts
each episode to the signed webhook.

1. The champion serves toolcalc v1 traffic; its traces land in Postgres.
2. The tool API drifts to v2: the champion fails, the failures are ingested.
3. Cycle 1 curates, snapshots (train / eval / regression / held-out), trains a candidate from
   the champion (GRPO on the curated train tasks, verifier rewards only, a KL anchor to the
   champion) and evaluates both with sampled evals on every set. The gate runs in **auto**
   mode and promotes on merit: a significant win on the new failures, with the regression
   suite holding.
4. The model server answers with the candidate's version; the canary reads its new traces
   from Postgres.
5. A live regression makes the canary roll back: the API drifts again (to v3, which neither
   model has seen), the candidate fails live, the canary drops it; the server answers with
   the previous champion again, and the loop's champion never moved.

The assertions read Postgres rows and what the model server answers, never logs.

The champion is pre-exposed to v2's names. ``tests/e2e/fixtures/toolcalc-champion`` (made
by ``python -m tests.e2e.champion_fixture``, with ``ratchet demo``'s settings) is a tiny GPT
SFT'd on toolcalc v1 demonstrations of which 30 % show v2's deprecation window (v2's
listing, a quarter of those already calling the new names), and v1 accepts v2's names as
aliases. On 40 fresh tasks per version it passes v1 100 % and v2 0 % greedy, v2 5 % sampled
(4 samples at temperature 0.7). So GRPO here amplifies a habit the champion has; it does not
learn a drift from nothing, which a few dozen curated tasks in CI time cannot teach a
v1-only champion (SFT on them left such a champion at 0 % on v2 and cost it 84 regression
points, measured in this test's earlier manual-gate version). What this test proves is the
loop: a real gate promotes a real win, and a real canary undoes a live loss.

Measured in four runs on a shared 2-core machine (three at the committed lr 3e-4, one at
5e-4; pass@1 from 4 samples at 0.7): eval set (10-11 curated v2 failures) champion
17.5-25 % vs candidate 90-98 %, every discordant task in the candidate's favour (one-sided
p <= 0.001); regression suite (16 v1 tasks) 100 % vs 100 % at lr 3e-4 (92 % at lr 5e-4,
hence a tolerance of 10 points rather than less); held-out 31 % vs 96-98 %; the train job
50-80 s and the whole test 130-205 s, depending on the load.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from services.artifacts import ArtifactStore, uri_to_path
from services.client import LoopPolicies
from services.db.models import Cycle, Dataset, Evaluation, Loop, Promotion, Task, Trace
from services.demo.options import DemoOptions
from services.demo.server import start_model_server
from services.demo.traffic import ServedModel, TraceDestination, TrafficSimulator
from services.executors.base import SPEC_FILE
from tests.e2e.champion_fixture import FIXTURE
from tests.e2e.support import LiveStack, cycle_closed, loop_cycle, new_tasks_trigger, wait_for
from tests.support import assert_nothing_trained_is_judged
from workflows.ids import run_id_for

pytestmark = pytest.mark.slow


LOOP = "closed"
MIN_NEW_TASKS = 12

# ``ratchet demo``'s GRPO (docs/environments.md), smaller: fewer steps and groups, so the
# train job takes about a minute on a busy 2-core machine; the KL anchor keeps v1.
TRAINING_PROFILE: dict[str, Any] = {
    "algorithm": "grpo",
    "device": "cpu",
    "hyperparameters": {
        **DemoOptions().grpo_hyperparameters,
        "steps": 30,
        "group_size": 8,
        "threads": 1,
    },
}
GATE_POLICY: dict[str, Any] = {
    "mode": "auto",
    "confidence": 0.9,
    "eval_samples": 4,
    "eval_temperature": 0.7,
    "min_discordant_pairs": 4,
    # The regression suite is the sampled v1 successes on the judged side (clusters hashed
    # eval or held-out: about 45 % of ~40, at most max_regression_tasks; the rest are the
    # replay split): one task is 6-8 points, so this allows losing about one of them,
    # pass@1 summed.
    "regression_tolerance_points": 10,
    # The canary's baseline is the champion's traces before the deploy: about 40 v1
    # successes and 65 v2 failures, ~38 % success. On v3 the candidate still passes ~15 %
    # (measured: 184 of 1,236 live traces), so the floor (baseline - 5 points) sits well
    # above the interval of a 200-trace window at 15 % (up to ~21 %). With 20 v1 successes
    # and a 10-point drop the floor was 16 % against that same 15 %: a coin toss.
    "canary_seconds": 240,
    "canary_check_interval_s": 1,
    "canary_min_traces": 10,
    "canary_max_drop_points": 5,
}
TRIGGER_POLICY = new_tasks_trigger(MIN_NEW_TASKS)
CURATION_POLICY: dict[str, Any] = {
    "success_sample_rate": 1.0,
    "eval_fraction": 0.3,
    "heldout_fraction": 0.15,
    "heldout_max_tasks": 16,
    "max_eval_tasks": 24,
    "max_regression_tasks": 16,
}


@pytest.fixture
def model_server(live: LiveStack) -> Iterator[str]:
    """``ratchet serve`` with the champion, on the stack's serve port; its URL."""
    process = start_model_server(live.settings, FIXTURE)
    try:
        yield f"http://{live.settings.serve_host}:{live.settings.serve_port}"
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()


def test_the_closed_loop_promotes_serves_watches_and_rolls_back(
    live: LiveStack, model_server: str
) -> None:
    with live.diagnostics(), live.client() as client:
        policies = LoopPolicies(
            serving_target={"kind": "local"},
            training_profile=TRAINING_PROFILE,
            gate_policy=GATE_POLICY,
            trigger_policy=TRIGGER_POLICY,
            curation_policy=CURATION_POLICY,
        )
        created = client.create_loop(LOOP, "toolcalc", policies=policies)
        client.set_champion(LOOP, str(FIXTURE))
        champion = _loop(live).champion_checkpoint_id
        assert champion is not None
        assert _served_version(model_server, _serve_key(live)) == champion

        api = ["v1"]

        def production() -> TrafficSimulator:
            """Production traffic from now on (a simulator runs once: start, then stop)."""
            return TrafficSimulator(
                served=ServedModel(url=model_server, api_key=_serve_key(live)),
                destination=TraceDestination(
                    api_url=live.api_url,
                    loop=LOOP,
                    signing_secret=created.signing_secret,
                    batch_size=2,
                ),
                api_version=lambda: api[0],
                rate_per_s=6,
                workers=2,
            )

        running: list[TrafficSimulator] = []

        def start_production() -> TrafficSimulator:
            traffic = production()
            running.append(traffic)
            traffic.start()
            return traffic

        try:
            _run_the_story(live, client, start_production, api, champion, model_server)
        finally:
            for traffic in running:
                traffic.stop()


def _run_the_story(
    live: LiveStack,
    client: Any,
    start_production: Callable[[], TrafficSimulator],
    api: list[str],
    champion: str,
    model_server: str,
) -> None:
    traffic = start_production()
    # 1. The champion serves v1 traffic; its traces are stored with its version.
    wait_for(
        lambda: _assert_at_least(_trace_count(live, champion, success=True), 40),
        timeout=240,
        interval=0.5,
        what="successful v1 traces of the champion",
    )
    # 2. Drift: v2 goes live and the champion fails on it.
    api[0] = "v2"
    wait_for(
        lambda: _assert_at_least(_trace_count(live, champion, success=False), 60),
        timeout=240,
        interval=0.5,
        what="failing v2 traces of the champion",
    )
    # Production pauses while the cycle runs, so the canary's baseline — the champion's
    # newest traces before the deploy — is a mix of v1 and v2, as after any drift.
    traffic.stop()
    client.start_loop(LOOP)

    # 3. Cycle 1 curates, trains, evaluates; the gate promotes on its own.
    promotion = wait_for(
        _promotion_in_canary(live), timeout=900, interval=0.5, what="a promotion in canary"
    )
    cycle = loop_cycle(live, LOOP)
    candidate = cycle.candidate_checkpoint_id
    assert candidate is not None and candidate != champion
    assert (promotion.decision, promotion.decided_by) == ("promote", "gate"), promotion.reason
    assert promotion.candidate_checkpoint_id == candidate
    assert promotion.previous_checkpoint_id == champion
    _assert_the_gate_saw_a_real_win(promotion)
    _assert_every_set_was_evaluated(live, cycle, champion, candidate, promotion)

    # 4. The served version changed; the canary reads the candidate's new traces.
    assert _served_version(model_server, _serve_key(live)) == candidate
    assert _loop(live).champion_checkpoint_id == champion  # moves only when the canary holds
    traffic = start_production()
    wait_for(
        lambda: _assert_at_least(_trace_count(live, candidate), 4),
        timeout=120,
        interval=0.5,
        what="live traces of the candidate",
    )

    # 5. A live regression: v3 goes live; the canary rolls back to the champion.
    api[0] = "v3"
    closed = wait_for(cycle_closed(live, LOOP), timeout=300, interval=0.5, what="cycle 1 to close")
    traffic.stop()
    assert closed.outcome == "rolled_back", (
        closed.outcome,
        closed.outcome_detail,
        _live_outcomes(live),
    )
    with live.sessions()() as session:
        final = session.get(Promotion, promotion.id)
        assert final is not None
        assert final.status == "rolled_back" and final.rolled_back_at is not None
        assert final.deployed_at is not None
        after_deploy = session.scalar(
            select(func.count())
            .select_from(Trace)
            .where(Trace.model_version == candidate, Trace.received_at >= final.deployed_at)
        )
    assert after_deploy and after_deploy >= GATE_POLICY["canary_min_traces"]
    assert _loop(live).champion_checkpoint_id == champion
    assert _served_version(model_server, _serve_key(live)) == champion
    # Proof of delivery: the server answered each deployed checkpoint's probe set (its eval
    # job's greedy answers) token for token, the candidate's and the champion's put back.
    delivery = final.statistics["delivery"]
    for purpose in ("candidate", "restore"):
        assert delivery[purpose]["verified"] is True, delivery
        assert delivery[purpose]["note"].startswith("verified: "), delivery

    # The cycle's three numbers: the gate's eval-set delta as measured, no held-out points
    # (serving did not keep the candidate), and the measured live drop with its interval.
    assert closed.gate_points == pytest.approx(promotion.statistics["delta_points"])
    assert closed.points_gained == 0.0
    assert closed.live_points is not None and closed.live_points < 0
    detail = closed.points_detail
    assert {"gate", "heldout", "live"} <= set(detail)
    live_detail = detail["live"]
    assert live_detail["ci_low_points"] < closed.live_points < live_detail["ci_high_points"]
    assert live_detail["n_after"] >= GATE_POLICY["canary_min_traces"]


# Verdicts ---------------------------------------------------------------------------------


def _assert_the_gate_saw_a_real_win(promotion: Promotion) -> None:
    """The numbers behind the auto gate's promote clear the policy, as the gate says."""
    statistics = promotion.statistics
    main = statistics["eval"]
    assert statistics["delta_points"] > 0, promotion.reason
    assert main["only_candidate"] > main["only_champion"], main
    assert main["discordant"] >= GATE_POLICY["min_discordant_pairs"], main
    assert main["p_value_improvement"] < 1 - GATE_POLICY["confidence"], main
    regression = statistics["regression"]
    # A drop beyond the tolerance refuses only where the suite shows it (a significant loss).
    beyond_tolerance = -regression["delta_points"] > GATE_POLICY["regression_tolerance_points"]
    shown = regression["p_value_loss"] < 1 - GATE_POLICY["confidence"]
    assert not (beyond_tolerance and shown), regression
    assert statistics["regression_check"] != "significant_loss", statistics
    # The win carries over to the frozen held-out set, which training never saw.
    assert statistics["heldout"]["delta"] > 0, statistics["heldout"]
    # pass@k beside pass@1 (4 samples per task): what sampling still reaches, both sides.
    for side in ("champion", "candidate"):
        reach = statistics["pass_at_k"][side]
        assert set(reach) == {"1", "2", "4"}, reach
        assert reach["1"] <= reach["2"] <= reach["4"], reach


def _assert_every_set_was_evaluated(
    live: LiveStack, cycle: Cycle, champion: str, candidate: str, promotion: Promotion
) -> None:
    with live.sessions()() as session:
        dataset = session.get(Dataset, cycle.dataset_id)
        assert dataset is not None
        # The frozen held-out set is sampled from all traffic and evaluated, never trained.
        assert dataset.heldout_count > 0 and dataset.heldout_uri is not None
        origins = set(
            session.scalars(
                select(Task.origin).where(Task.loop_id == cycle.loop_id, Task.split == "heldout")
            ).all()
        )
        evaluations = session.scalars(
            select(Evaluation).where(Evaluation.cycle_id == cycle.id)
        ).all()
    assert origins, "no held-out tasks"
    by_set = {(e.checkpoint_id, e.task_set): e for e in evaluations}
    for checkpoint in (champion, candidate):
        for task_set in ("eval", "regression", "heldout"):
            assert (checkpoint, task_set) in by_set, (checkpoint, task_set, sorted(by_set))
    eval_champion, eval_candidate = by_set[champion, "eval"], by_set[candidate, "eval"]
    assert eval_champion.n == eval_candidate.n == dataset.eval_count
    assert by_set[champion, "heldout"].n == dataset.heldout_count
    # The gate's statistics hold both comparisons, each with its interval.
    statistics = promotion.statistics
    assert statistics["eval"]["n"] == dataset.eval_count
    assert statistics["heldout"]["n"] == dataset.heldout_count
    assert statistics["heldout_points"] == pytest.approx(100 * statistics["heldout"]["delta"])
    expected = 100 * (eval_candidate.pass_rate - eval_champion.pass_rate)
    assert statistics["delta_points"] == pytest.approx(expected)
    # Nothing the train job was handed (its dataset, replay file, stored demonstrations)
    # is in a set that judged its candidate.
    run_dir = ArtifactStore(live.settings.artifacts_dir).run_dir(
        LOOP, run_id_for(LOOP, cycle.number, "train")
    )
    train_spec = json.loads((run_dir / SPEC_FILE).read_text(encoding="utf-8"))
    judged = {
        name: uri_to_path(uri) if uri else None
        for name, uri in (
            ("eval", dataset.eval_uri),
            ("regression", dataset.regression_uri),
            ("heldout", dataset.heldout_uri),
        )
    }
    assert_nothing_trained_is_judged(train_spec, judged)


# Reading the world ------------------------------------------------------------------------


def _assert_at_least(value: int, minimum: int) -> None:
    assert value >= minimum, f"{value} < {minimum}"


def _serve_key(live: LiveStack) -> str:
    assert live.settings.serve_api_key is not None
    return live.settings.serve_api_key.get_secret_value()


def _served_version(model_server: str, key: str | None = None) -> str:
    """The checkpoint the server answers the loop's model name with (its own model card)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    card = httpx.get(f"{model_server}/v1/models/ratchet", headers=headers, timeout=30).json()
    version: str = card["ratchet"]["version"]
    return version


def _loop(live: LiveStack) -> Loop:
    with live.sessions()() as session:
        return session.scalars(select(Loop).where(Loop.name == LOOP)).one()


def _trace_count(live: LiveStack, version: str, *, success: bool | None = None) -> int:
    with live.sessions()() as session:
        query = (
            select(func.count())
            .select_from(Trace)
            .join(Loop)
            .where(Loop.name == LOOP, Trace.model_version == version)
        )
        if success is not None:
            query = query.where(Trace.success.is_(success))
        return int(session.scalar(query) or 0)


def _live_outcomes(live: LiveStack) -> dict[str, int]:
    """Traces per model version, API version and outcome: what the canary had to judge."""
    with live.sessions()() as session:
        rows = session.execute(
            select(Trace.model_version, Trace.body, Trace.success)
            .join(Loop)
            .where(Loop.name == LOOP)
        ).all()
    counts: dict[str, int] = {}
    for version, body, success in rows:
        api_version = (body.get("metadata") or {}).get("api_version")
        key = f"{(version or '?')[:12]} {api_version} {'pass' if success else 'fail'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _promotion_in_canary(live: LiveStack) -> Callable[[], Promotion]:
    def check() -> Promotion:
        cycle = loop_cycle(live, LOOP)
        if cycle.ended_at is not None:
            pytest.fail(f"cycle 1 ended before its canary: {cycle.outcome}: {cycle.outcome_detail}")
        with live.sessions()() as session:
            promotion = session.scalars(
                select(Promotion).where(Promotion.cycle_id == cycle.id)
            ).one_or_none()
        assert promotion is not None, f"stage is {cycle.stage}"
        assert promotion.status == "canary", promotion.status
        return promotion

    return check

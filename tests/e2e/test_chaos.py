"""Chaos acceptance (issue 7): ``kill -9`` the worker during training, evaluation and promotion.

Everything is a real process: the embedded Postgres and Temporal dev server, ``ratchet api``,
``ratchet worker`` and the jobs the local executor starts. One loop runs one cycle from
failing production traces; the worker is SIGKILLed while the train job runs, while the eval
jobs run, and during the promotion's canary, and restarted each time. While it is dead,
production keeps posting (a webhook retry of every trace, plus new ones).

After the restarts the cycle must complete (manual gate, approved through the api, so the
candidate is promoted whatever its quality) with exactly one job per run id, exactly one
promotion decision for the cycle, every posted trace stored once and curated exactly once.
Each kill costs one heartbeat timeout (60 s in the stage workflows) before Temporal hands
the interrupted ``run_job`` activity to the new worker, so the test takes a few minutes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from ratchet_client import TraceClient
from sqlalchemy import func, select

from services.client import ApiRequestError, ApiUnreachable, LoopPolicies, RatchetClient
from services.db.models import Cycle, Dataset, Loop, Promotion, Run, Task, TaskSource, Trace
from tests.e2e.support import (
    LiveStack,
    cycle_closed,
    loop_cycle,
    make_tiny_champion,
    new_tasks_trigger,
    toolcalc_traces,
    wait_for,
)
from workflows.ids import cycle_workflow_id, run_id_for

pytestmark = pytest.mark.slow


T = TypeVar("T")
LOOP = "chaos"
MIN_NEW_TASKS = 8
TRAIN_RUN = run_id_for(LOOP, 1, "train")
# A loop's first cycle measures its rates with a short pass of its train job first
# (workflows/cycle.py, calibrate): a run of its own, before the one the test kills.
CALIBRATE_RUN = run_id_for(LOOP, 1, "calibrate")

# Jobs small enough for seconds each, yet a train job long enough to be killed under.
TRAINING_PROFILE: dict[str, Any] = {
    "algorithm": "grpo",
    "device": "cpu",
    "hyperparameters": {
        "steps": 60,
        "tasks_per_step": 4,
        "group_size": 4,
        "max_turns": 3,
        "max_new_tokens": 16,
        # An SFT term on the reference answers: the weights change even when every GRPO
        # group has zero variance, so the candidate is a checkpoint of its own.
        "sft_coef": 0.5,
        "threads": 1,
    },
}
GATE_POLICY: dict[str, Any] = {
    "mode": "manual",
    "eval_samples": 4,
    "canary_seconds": 8,
    "canary_check_interval_s": 1,
    # No live traffic reaches the new version: the canary holds, it never rolls back.
    "canary_min_traces": 10_000,
}
TRIGGER_POLICY = new_tasks_trigger(MIN_NEW_TASKS)
CURATION_POLICY: dict[str, Any] = {
    "eval_fraction": 0.3,
    "heldout_fraction": 0.0,
    "success_sample_rate": 1.0,
}


def test_a_cycle_survives_kill9_of_the_worker_in_train_evaluate_and_promote(
    live: LiveStack, tmp_path: Path
) -> None:
    with live.diagnostics(), live.client() as client:
        _chaos(live, client, tmp_path)


def _chaos(live: LiveStack, client: RatchetClient, tmp_path: Path) -> None:
    policies = LoopPolicies(
        training_profile=TRAINING_PROFILE,
        serving_target={"kind": "none"},
        gate_policy=GATE_POLICY,
        trigger_policy=TRIGGER_POLICY,
        curation_policy=CURATION_POLICY,
    )
    created = client.create_loop(LOOP, "toolcalc", policies=policies)
    client.set_champion(LOOP, str(make_tiny_champion(tmp_path / "champion")))
    first = toolcalc_traces(40, seed=11, passing=False, id_prefix="first-fail")
    first += toolcalc_traces(6, seed=12, passing=True, id_prefix="first-ok")
    traces = TraceClient(live.api_url, LOOP, created.signing_secret)
    assert traces.post(first).accepted == len(first)
    client.start_loop(LOOP)

    # 1. Training: kill the worker while the train job runs.
    wait_for(_train_job_running(live), timeout=300, what="cycle 1's train job to run")
    assert not live.job_has_ended(LOOP, TRAIN_RUN), "the train job ended before the kill"
    live.kill_worker()
    # Production does not stop while no worker runs: a webhook retry of every trace (no-op)
    # and new traces, some of them repeats of tasks already curated.
    retried = traces.post(first)
    assert (retried.accepted, retried.duplicates) == (0, len(first))
    repeats = toolcalc_traces(4, seed=11, passing=False, id_prefix="second-repeat")
    second = repeats + toolcalc_traces(3, seed=13, passing=False, id_prefix="second-fail")
    second += toolcalc_traces(2, seed=14, passing=True, id_prefix="second-ok")
    assert traces.post(second).accepted == len(second)
    traces.close()
    live.start_worker()

    # 2. Evaluation: kill the worker while the eval jobs run.
    eval_runs = wait_for(_eval_jobs_running(live), timeout=240, what="cycle 1's eval jobs to run")
    in_flight_evals = {r for r in eval_runs if not live.job_has_ended(LOOP, r)}
    assert in_flight_evals, "every eval job ended before the kill"
    live.kill_worker()
    live.start_worker()

    # 3. The manual gate: approve through the api whatever the gate recommends.
    wait_for(_awaiting_approval(live), timeout=240, what="the manual gate of cycle 1")
    client.action(LOOP, "approve", reason="chaos test: promote", by="chaos-test")

    # 4. Promotion: kill the worker during the canary window.
    wait_for(_promotion_in_canary(live), timeout=120, what="cycle 1's promotion to deploy")
    live.kill_worker()
    live.start_worker()

    # 5. The cycle completes, and the traces posted meanwhile are curated after it.
    cycle = wait_for(cycle_closed(live, LOOP), timeout=240, what="cycle 1 to close")
    wait_for(lambda: _assert_equal(_uncurated(live), 0), timeout=120, what="every trace curated")

    _assert_cycle_promoted_once(live, cycle)
    _assert_one_job_per_run(live, cycle, eval_runs, in_flight_evals)
    _assert_traces_stored_and_curated_once(live, first + second, repeats)
    _assert_dashboard_shows_the_cycle(live)


# Waiting -----------------------------------------------------------------------------------


def _assert_equal(actual: T, expected: T) -> None:
    assert actual == expected, f"{actual!r} != {expected!r}"


def _open_cycle(live: LiveStack) -> Cycle:
    """Cycle 1, which must not have ended yet (a stage failing ends it early)."""
    cycle = loop_cycle(live, LOOP)
    if cycle.ended_at is not None:  # no point waiting on: fail now, with the reason
        pytest.fail(f"cycle 1 ended early: {cycle.outcome}: {cycle.outcome_detail}")
    return cycle


def _runs(live: LiveStack, cycle: Cycle) -> dict[str, Run]:
    with live.sessions()() as session:
        rows = session.scalars(select(Run).where(Run.cycle_id == cycle.id)).all()
    return {row.id: row for row in rows}


def _train_job_running(live: LiveStack) -> Callable[[], None]:
    def check() -> None:
        cycle = _open_cycle(live)
        assert cycle.stage == "train", f"stage is {cycle.stage}"
        run = _runs(live, cycle).get(TRAIN_RUN)
        assert run is not None and run.status == "running", run and run.status

    return check


def _expected_eval_runs(live: LiveStack, cycle: Cycle) -> set[str]:
    assert cycle.dataset_id is not None
    with live.sessions()() as session:
        dataset = session.get(Dataset, cycle.dataset_id)
    assert dataset is not None
    task_sets = ["eval"] + (["regression"] if dataset.regression_count else [])
    return {
        run_id_for(LOOP, 1, "eval", f"{role}-{task_set}")
        for role in ("champion", "candidate")
        for task_set in task_sets
    }


def _eval_jobs_running(live: LiveStack) -> Callable[[], set[str]]:
    def check() -> set[str]:
        cycle = _open_cycle(live)
        assert cycle.stage == "evaluate", f"stage is {cycle.stage}"
        expected = _expected_eval_runs(live, cycle)
        runs = _runs(live, cycle)
        statuses = {run_id: runs[run_id].status for run_id in expected if run_id in runs}
        assert set(statuses) == expected, f"eval runs so far: {statuses}"
        assert all(s in ("running", "succeeded") for s in statuses.values()), statuses
        assert "running" in statuses.values(), statuses
        return expected

    return check


def _awaiting_approval(live: LiveStack) -> Callable[[], None]:
    def check() -> None:
        _open_cycle(live)
        with live.client() as client:
            try:
                stage = client.status(LOOP).get("stage")
            except (ApiRequestError, ApiUnreachable) as exc:
                # The query is answered by a worker; while one restarts it may not be.
                raise AssertionError(f"status not available: {exc}") from exc
        assert stage == "awaiting_approval", f"the loop's stage is {stage}"

    return check


def _promotion_in_canary(live: LiveStack) -> Callable[[], None]:
    def check() -> None:
        cycle = _open_cycle(live)
        assert cycle.stage == "promote", f"stage is {cycle.stage}"
        with live.sessions()() as session:
            statuses = session.scalars(
                select(Promotion.status).where(Promotion.cycle_id == cycle.id)
            ).all()
        assert list(statuses) == ["canary"], statuses

    return check


def _uncurated(live: LiveStack) -> int:
    with live.sessions()() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Trace)
                .join(Loop)
                .where(Loop.name == LOOP, Trace.curated_at.is_(None))
            )
            or 0
        )


# Verdicts ----------------------------------------------------------------------------------


def _assert_cycle_promoted_once(live: LiveStack, cycle: Cycle) -> None:
    assert cycle.outcome == "promoted", (cycle.outcome, cycle.outcome_detail)
    with live.sessions()() as session:
        decisions = session.scalars(select(Promotion).where(Promotion.cycle_id == cycle.id)).all()
        loop = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
    assert len(decisions) == 1, [(p.id, p.decision, p.status) for p in decisions]
    decision = decisions[0]
    assert (decision.decision, decision.status, decision.decided_by) == (
        "promote",
        "held",
        "chaos-test",
    ), decision.reason
    assert decision.candidate_checkpoint_id == cycle.candidate_checkpoint_id
    assert decision.candidate_checkpoint_id != decision.previous_checkpoint_id
    assert loop.champion_checkpoint_id == cycle.candidate_checkpoint_id


def _assert_one_job_per_run(
    live: LiveStack, cycle: Cycle, eval_runs: set[str], in_flight_evals: set[str]
) -> None:
    runs = _runs(live, cycle)
    assert set(runs) - {CALIBRATE_RUN} == {TRAIN_RUN, *eval_runs}
    # No job ran under any other run id either: one run directory per run row.
    run_dirs = {path.name for path in live.run_dir(LOOP, TRAIN_RUN).parent.iterdir()}
    assert run_dirs == set(runs)
    for run_id, run in runs.items():
        assert run.status == "succeeded", (run_id, run.status, run.error)
        launches = live.job_launches(LOOP, run_id)
        # The worker started the job once (and the restarted workers adopted it) ...
        assert launches.started_lines == 1, (run_id, launches.started_lines)
        # ... the supervisor that ran is the one in the run's handle, and it saw one exit.
        assert launches.handle_pid is not None
        assert launches.handle_pid == launches.supervisor_pid, launches
        assert launches.exit is not None and launches.exit["returncode"] == 0, launches.exit
        assert run.handle is not None and run.handle["pid"] == launches.handle_pid
        # ... and the job's own log (appended to by every launch) shows one run of it.
        if run_id == TRAIN_RUN:
            assert launches.job_log.count("grpo step 1/") == 1, launches.job_log[-2000:]
            assert launches.job_log.count("wrote checkpoint") == 1, launches.job_log[-2000:]
        elif run_id != CALIBRATE_RUN:  # no kill met the calibration pass: its launch is enough
            assert launches.job_log.count(f"eval {run_id}:") == 1, launches.job_log[-2000:]

    # The kills really interrupted the jobs' activities: each one in flight ended on a later
    # attempt, after the killed worker's attempt timed out on its heartbeat.
    killed = {TRAIN_RUN: cycle_workflow_id(LOOP, 1, "train")}
    killed.update({r: cycle_workflow_id(LOOP, 1, "evaluate") for r in in_flight_evals})
    for workflow_id in set(killed.values()):
        attempts = live.run_job_attempts(workflow_id)
        for run_id in (r for r, w in killed.items() if w == workflow_id):
            attempt = attempts[run_id]
            assert attempt.attempt >= 2, (run_id, attempt)
            assert attempt.previous_failure_was_heartbeat_timeout, (run_id, attempt)


def _assert_traces_stored_and_curated_once(
    live: LiveStack, posted: list[dict[str, Any]], repeats: list[dict[str, Any]]
) -> None:
    posted_ids = {trace["external_id"] for trace in posted}
    with live.sessions()() as session:
        loop_id = session.scalars(select(Loop.id).where(Loop.name == LOOP)).one()
        traces = session.scalars(select(Trace).where(Trace.loop_id == loop_id)).all()
        sources = session.execute(
            select(TaskSource.trace_id, TaskSource.relation)
            .join(Task, Task.id == TaskSource.task_id)
            .where(Task.loop_id == loop_id)
        ).all()
        tasks = session.scalars(select(Task).where(Task.loop_id == loop_id)).all()
    stored = Counter(trace.external_id for trace in traces)
    # No trace lost, none stored twice (the retried post was a no-op).
    assert set(stored) == posted_ids
    assert max(stored.values()) == 1
    # Every trace curated, exactly once: one outcome, and at most one task source each.
    assert all(trace.curated_at is not None for trace in traces)
    per_trace = Counter(trace_id for trace_id, _ in sources)
    assert max(per_trace.values()) == 1, per_trace.most_common(3)
    with_task = {t.id for t in traces if t.curation_outcome in ("task", "duplicate")}
    assert set(per_trace) == with_task
    # One origin per task, and each folded duplicate raised its task's weight once.
    relations = Counter(relation for _, relation in sources)
    assert relations["origin"] == len(tasks)
    assert sum(task.weight for task in tasks) == len(sources)
    # Repeats posted during the chaos were folded into the tasks curated before it.
    outcome = {trace.external_id: trace.curation_outcome for trace in traces}
    assert {outcome[trace["external_id"]] for trace in repeats} == {"duplicate"}


def _assert_dashboard_shows_the_cycle(live: LiveStack) -> None:
    """The dashboard renders the real cycle this test produced (read-only, no token)."""
    with live.sessions()() as session:
        loop = session.scalars(select(Loop).where(Loop.name == LOOP)).one()
        champion = loop.champion_checkpoint_id
    assert champion is not None
    for path in ("/", f"/loops/{LOOP}", f"/loops/{LOOP}/runs/{TRAIN_RUN}"):
        response = httpx.get(f"{live.api_url}{path}", timeout=30)
        assert response.status_code == 200, (path, response.status_code)
    loop_page = httpx.get(f"{live.api_url}/loops/{LOOP}", timeout=30).text
    assert champion[:12] in loop_page
    assert "promoted" in loop_page

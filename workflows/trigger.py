"""When LoopWorkflow starts a cycle, and why: its trigger check (:func:`check_trigger`), and
how long an idle loop waits before the next one (:func:`next_check_s`).

Each check first curates what arrived (the cycle's curate settings, at most
``TRIGGER_CHECK_MAX_BATCHES`` batches), then answers, in order: a bootstrap asked for (an
operator's, or the training profile's automatic one when the loop has no champion and
enough successful train-split traces: workflows/bootstrap.py), an operator's run-now, and,
for a loop with a champion to train from, enough new train tasks (``min_new_tasks``), a
drift of the served model's failure rate, or the maximum interval since the last cycle.

An idle loop costs what its checks cost: each activity and timer is a Temporal action and a
database transaction on the worker. Since the ``idle-backoff`` patch (:data:`IDLE_PATCH`) a
check first asks what is pending and curates only when a trace is waiting (an idle check is
two activities, not three), and a check that found nothing new doubles the wait before the
next one, from ``check_interval_s`` up to ``idle_check_interval_s``, never past the moment
the maximum interval would start a cycle. New traffic does not wait out the backoff: the api
signals ``wake`` on the first trace after a quiet spell (services/api/wake.py), and so does
every operator signal.

Workflow code (deterministic, no I/O); imported by workflows/loop.py inside
``imports_passed_through``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from temporalio import workflow

from workflows.activities.bootstrap import BootstrapActivities
from workflows.activities.curation import CurationActivities
from workflows.bootstrap import BOOTSTRAP_PATCH, BOOTSTRAP_TRIGGER, request_detail
from workflows.curate import curate_batches
from workflows.options import LONG_DB_TIMEOUT, db_activity
from workflows.payloads.bootstrap import BootstrapReadinessInput
from workflows.payloads.curation import (
    CurateInput,
    DriftInput,
    PendingWorkInput,
    PendingWorkResult,
)
from workflows.payloads.loop import BootstrapSignal, LoopConfig, LoopState

# Batches one trigger check curates at most; what is left waits for the next check.
TRIGGER_CHECK_MAX_BATCHES = 100
# workflow.patched id of the idle backoff: a check curates only when a trace is waiting, and
# checks that find nothing new wait longer and longer (up to the trigger policy's
# ``idle_check_interval_s``) unless a signal wakes the loop. Histories before it curated on
# every check and waited ``check_interval_s`` between checks.
IDLE_PATCH = "idle-backoff"
# workflow.patched id: a loop with no champion starts no cycle by itself (histories before
# it started one, which failed for want of a champion).
NO_CHAMPION_PATCH = "no-champion-no-automatic-cycle"


@dataclass
class TriggerCheck:
    """What one check decided: the trigger (None: no cycle now) with the detail the cycle's
    row records, whether it found anything new (``quiet``: no trace curated, no trigger), and
    how long until the maximum interval would start a cycle (None: it cannot yet)."""

    trigger: str | None
    detail: dict[str, object] = field(default_factory=dict)
    quiet: bool = False
    until_max_interval_s: float | None = None


async def check_trigger(loop: str, state: LoopState, config: LoopConfig) -> TriggerCheck:
    """Curate what arrived, then decide whether a cycle starts now and why (the trigger and
    its detail, which the cycle's row records). Consumes a run-now; a bootstrap request
    stays in ``state`` until its cycle starts."""
    pending, curated = await _curate_pending(loop)
    trigger, detail = await _decide(loop, state, config, pending)
    check = TriggerCheck(trigger, detail, quiet=trigger is None and curated == 0)
    if trigger is None and pending.new_train_tasks > 0 and state.last_cycle_ended_at:
        ended = datetime.fromisoformat(state.last_cycle_ended_at)
        elapsed = (workflow.now() - ended).total_seconds()
        check.until_max_interval_s = max(0.0, config.trigger_policy.max_interval_s - elapsed)
    return check


async def _curate_pending(loop: str) -> tuple[PendingWorkResult, int]:
    """What is pending after curating what arrived, and how many traces were curated."""
    batches = CurateInput(loop, max_batches=TRIGGER_CHECK_MAX_BATCHES)
    if not workflow.patched(IDLE_PATCH):
        curated = await curate_batches(batches)
        pending = await db_activity(CurationActivities.pending_work, PendingWorkInput(loop))
        return pending, curated.traces_seen
    pending = await db_activity(CurationActivities.pending_work, PendingWorkInput(loop))
    if pending.uncurated_traces <= 0:
        return pending, 0
    curated = await curate_batches(batches)
    pending = await db_activity(CurationActivities.pending_work, PendingWorkInput(loop))
    return pending, curated.traces_seen


def next_check_s(config: LoopConfig, idle_checks: int, until_max_interval_s: float | None) -> float:
    """How long to wait before the next check after ``idle_checks`` quiet checks in a row:
    ``check_interval_s`` doubled for each, at most ``idle_check_interval_s`` (when that is
    longer), and never past the moment the maximum interval would start a cycle.

    Pure workflow code (no I/O, deterministic)."""
    policy = config.trigger_policy
    base = policy.check_interval_s
    ceiling = max(base, policy.idle_check_interval_s)
    wait = min(ceiling, base * 2.0 ** min(idle_checks, 32))
    if until_max_interval_s is not None:
        wait = min(wait, max(base, until_max_interval_s))
    return wait


async def _decide(
    loop: str, state: LoopState, config: LoopConfig, pending: PendingWorkResult
) -> tuple[str | None, dict[str, object]]:
    """The trigger of a cycle now (None: none) and its detail, from what is pending."""
    detail: dict[str, object] = {"new_train_tasks": pending.new_train_tasks}
    # Checked first so a loop nobody asked to bootstrap records no marker.
    if state.bootstrap is not None and workflow.patched(BOOTSTRAP_PATCH):
        return BOOTSTRAP_TRIGGER, {**detail, **request_detail(state.bootstrap)}
    if state.run_now:
        state.run_now = False
        return "operator", detail
    if await _auto_bootstrap(loop, state, config):
        assert state.bootstrap is not None
        return BOOTSTRAP_TRIGGER, {**detail, **request_detail(state.bootstrap)}
    if pending.new_train_tasks <= 0:
        return None, detail
    # A loop with no champion has nothing to train from: only a bootstrap (above) or an
    # operator's run-now starts its cycle, not new tasks (a history posted before the
    # bootstrap), a drift or the interval. Checked here so a loop with a champion, or with
    # nothing pending, records no marker.
    if config.champion_checkpoint_id is None and workflow.patched(NO_CHAMPION_PATCH):
        return None, detail
    if pending.new_train_tasks >= config.trigger_policy.min_new_tasks:
        detail["min_new_tasks"] = config.trigger_policy.min_new_tasks
        return "min_new_tasks", detail
    if config.trigger_policy.drift_enabled:
        drift = await db_activity(CurationActivities.check_drift, DriftInput(loop))
        if drift.drifted:
            detail.update(
                failure_rate=drift.failure_rate,
                threshold=drift.threshold,
                model_version=drift.model_version,
            )
            return "drift", detail
    if state.last_cycle_ended_at is not None:
        ended = datetime.fromisoformat(state.last_cycle_ended_at)
        elapsed = (workflow.now() - ended).total_seconds()
        if elapsed >= config.trigger_policy.max_interval_s:
            detail["max_interval_s"] = config.trigger_policy.max_interval_s
            return "max_interval", detail
    return None, detail


async def _auto_bootstrap(loop: str, state: LoopState, config: LoopConfig) -> bool:
    """Whether the training profile's automatic bootstrap starts now (and its request put in
    ``state``): the loop has no champion, ``bootstrap.auto`` is on, and curation has seen
    enough successful train-split traces. The readiness activity looks again only when
    curation has seen new traces since its last look."""
    policy = config.training_profile.bootstrap
    # Checked first so a loop without the policy records no marker.
    if config.champion_checkpoint_id is not None or not policy.auto:
        return False
    if not workflow.patched(BOOTSTRAP_PATCH):
        return False
    ready = await db_activity(
        BootstrapActivities.readiness,
        BootstrapReadinessInput(loop, policy.min_successes, state.bootstrap_curated_seen),
        start_to_close=LONG_DB_TIMEOUT,
    )
    state.bootstrap_curated_seen = ready.curated
    if not ready.ready:
        return False
    state.bootstrap = BootstrapSignal(
        by="policy",
        reason=f"automatic: {ready.used} successful train-split traces (training_profile."
        f"bootstrap.min_successes is {policy.min_successes})",
    )
    return True

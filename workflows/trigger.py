"""When LoopWorkflow starts a cycle, and why: its trigger check (:func:`check_trigger`).

Each check first curates what arrived (the cycle's curate settings, at most
``TRIGGER_CHECK_MAX_BATCHES`` batches), then answers, in order: a bootstrap asked for (an
operator's, or the training profile's automatic one when the loop has no champion and
enough successful train-split traces: workflows/bootstrap.py), an operator's run-now, and,
for a loop with a champion to train from, enough new train tasks (``min_new_tasks``), a
drift of the served model's failure rate, or the maximum interval since the last cycle.

Workflow code (deterministic, no I/O); imported by workflows/loop.py inside
``imports_passed_through``.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from workflows.activities.bootstrap import BootstrapActivities
from workflows.activities.curation import CurationActivities
from workflows.bootstrap import BOOTSTRAP_PATCH, BOOTSTRAP_TRIGGER, request_detail
from workflows.curate import curate_batches
from workflows.options import LONG_DB_TIMEOUT, db_activity
from workflows.payloads.bootstrap import BootstrapReadinessInput
from workflows.payloads.curation import CurateInput, DriftInput, PendingWorkInput
from workflows.payloads.loop import BootstrapSignal, LoopConfig, LoopState

# Batches one trigger check curates at most; what is left waits for the next check.
TRIGGER_CHECK_MAX_BATCHES = 100
# workflow.patched id: a loop with no champion starts no cycle by itself (histories before
# it started one, which failed for want of a champion).
NO_CHAMPION_PATCH = "no-champion-no-automatic-cycle"


async def check_trigger(
    loop: str, state: LoopState, config: LoopConfig
) -> tuple[str | None, dict[str, object]]:
    """Curate what arrived, then decide whether a cycle starts now and why (the trigger and
    its detail, which the cycle's row records). Consumes a run-now; a bootstrap request
    stays in ``state`` until its cycle starts."""
    await curate_batches(CurateInput(loop, max_batches=TRIGGER_CHECK_MAX_BATCHES))
    pending = await db_activity(CurationActivities.pending_work, PendingWorkInput(loop))
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

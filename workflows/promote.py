"""PromoteWorkflow: deploy the winner, watch a canary window, hold or roll back.

The champion pointer moves only when the canary holds. During the window, live outcomes
from ingested traces of the new version are compared with the previous champion's; a
significant drop (the upper end of the new version's Wilson interval below the old rate
minus the tolerance) rolls back to the previous champion. Id ``loop/<name>/cycle/<n>/promote``.

Restoring the previous champion (after a failed deploy or a live regression) is itself a
deploy that can fail (the server is down, its proof of delivery refuses). It no longer
fails the workflow (behind :data:`RESTORE_GUARD_PATCH`, so histories recorded before keep
replaying): the promotion ends ``failed`` and its reason says that the restore failed too,
which an operator must see, since the server may still answer with the candidate.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from services.loop.states import PromotionStatus
    from workflows.activities.canary import CanaryActivities
    from workflows.activities.deploy import DeployActivities
    from workflows.options import BOUNDED_DB_RETRY, DEPLOY, db_activity, long_activity
    from workflows.payloads.promote import (
        DeployInput,
        DeployResult,
        LiveStats,
        LiveStatsInput,
        PromoteInput,
        PromoteResult,
        PromotionStatusInput,
    )


# Issue 43: a restore that fails is recorded on the promotion instead of failing the workflow.
RESTORE_GUARD_PATCH = "promote-guarded-restore"


@workflow.defn
class PromoteWorkflow:
    def __init__(self) -> None:
        self.phase = "deploying"

    @workflow.query
    def status(self) -> str:
        return self.phase

    @workflow.run
    async def run(self, input: PromoteInput) -> PromoteResult:
        await self._set_status(input, PromotionStatus.DEPLOYING)
        try:
            deployed = await self._deploy(
                input, input.candidate_checkpoint_id, input.candidate_uri, purpose="candidate"
            )
        except ActivityError as exc:
            reason = f"deploy of the candidate failed: {exc.cause or exc}"
            reason += await self._restore_previous(input)
            await self._set_status(input, PromotionStatus.FAILED, reason=reason)
            return PromoteResult(status=PromotionStatus.FAILED, reason=reason)

        self.phase = "canary"
        await self._set_status(input, PromotionStatus.CANARY, timestamp_field="deployed_at")
        baseline = await self._live_stats(
            input, input.previous_checkpoint_id, until=deployed.deployed_at
        )
        latest = LiveStats(n=0, successes=0, success_rate=None)
        deadline = workflow.now() + timedelta(seconds=input.canary_seconds)
        while workflow.now() < deadline:
            await workflow.sleep(timedelta(seconds=max(0.5, input.canary_check_interval_s)))
            latest = await self._live_stats(
                input, input.candidate_checkpoint_id, since=deployed.deployed_at
            )
            if self._regressed(input, baseline, latest):
                return await self._roll_back(input, baseline, latest)

        self.phase = "held"
        reason = (
            f"canary held: {_rate(latest)} live success on {latest.n} traces "
            f"(previous champion {_rate(baseline)}){_unattested(latest)}"
        )
        await self._set_status(
            input,
            PromotionStatus.HELD,
            reason=reason,
            set_champion=input.candidate_checkpoint_id,
            timestamp_field="canary_ended_at",
        )
        return _after_canary(PromotionStatus.HELD, reason, baseline, latest)

    def _regressed(self, input: PromoteInput, baseline: LiveStats, latest: LiveStats) -> bool:
        if latest.n < input.canary_min_traces or baseline.success_rate is None:
            return False
        if latest.ci_high is None:
            return False
        floor = baseline.success_rate - input.canary_max_drop_points / 100.0
        return latest.ci_high < floor

    async def _roll_back(
        self, input: PromoteInput, baseline: LiveStats, latest: LiveStats
    ) -> PromoteResult:
        self.phase = "rolling_back"
        regression = (
            f"live regression: {_rate(latest)} on {latest.n} traces (interval up to "
            f"{(latest.ci_high or 0) * 100:.1f}%) against {_rate(baseline)} before"
        )
        reason = f"{regression}; rolled back to {input.previous_checkpoint_id}"
        restore_failed = await self._restore_previous(input)
        if restore_failed:  # the candidate may still be serving: not a rollback
            reason = regression + restore_failed
            await self._set_status(input, PromotionStatus.FAILED, reason=reason)
            self.phase = "failed"
            return _after_canary(PromotionStatus.FAILED, reason, baseline, latest)
        await self._set_status(
            input, PromotionStatus.ROLLED_BACK, reason=reason, timestamp_field="rolled_back_at"
        )
        self.phase = "rolled_back"
        return _after_canary(PromotionStatus.ROLLED_BACK, reason, baseline, latest)

    async def _restore_previous(self, input: PromoteInput) -> str:
        """Deploy the previous champion again; "" when it is served (or there is none), else
        what went wrong, for the promotion's reason (see the module)."""
        if not (input.previous_checkpoint_id and input.previous_uri):
            return ""
        if not workflow.patched(RESTORE_GUARD_PATCH):
            await self._deploy(
                input, input.previous_checkpoint_id, input.previous_uri, purpose="restore"
            )
            return ""
        try:
            await self._deploy(
                input, input.previous_checkpoint_id, input.previous_uri, purpose="restore"
            )
        except ActivityError as exc:
            workflow.logger.warning("restoring the previous champion failed: %s", exc.cause or exc)
            return (
                f"; restoring the previous champion {input.previous_checkpoint_id[:12]} "
                f"failed too: {exc.cause or exc}"
            )
        return ""

    async def _deploy(
        self, input: PromoteInput, checkpoint_id: str, uri: str, *, purpose: str
    ) -> DeployResult:
        """Deploy, naming the cycle so the activity can refuse a deploy that slips back."""
        return await long_activity(
            DeployActivities.deploy_checkpoint,
            DeployInput(
                input.loop,
                input.serving_target,
                checkpoint_id,
                uri,
                cycle=input.cycle,
                purpose=purpose,
            ),
            DEPLOY,
        )

    async def _live_stats(
        self,
        input: PromoteInput,
        model_version: str | None,
        *,
        since: str | None = None,
        until: str | None = None,
    ) -> LiveStats:
        return await db_activity(
            CanaryActivities.live_stats,
            LiveStatsInput(
                input.loop,
                model_version,
                since=since,
                until=until,
                limit=max(input.canary_min_traces * 5, 200),
            ),
            retry=BOUNDED_DB_RETRY,
        )

    async def _set_status(
        self,
        input: PromoteInput,
        status: PromotionStatus,
        *,
        reason: str | None = None,
        set_champion: str | None = None,
        timestamp_field: str | None = None,
    ) -> None:
        await db_activity(
            CanaryActivities.update_promotion,
            PromotionStatusInput(
                loop=input.loop,
                promotion_id=input.promotion_id,
                status=status,
                reason=reason,
                set_champion=set_champion,
                timestamp_field=timestamp_field,
            ),
            retry=BOUNDED_DB_RETRY,
        )


def _after_canary(
    status: PromotionStatus, reason: str, baseline: LiveStats, latest: LiveStats
) -> PromoteResult:
    """Every verdict reached after a canary reports the live rates it was judged on."""
    return PromoteResult(
        status=status,
        reason=reason,
        live_before=baseline.success_rate,
        live_after=latest.success_rate,
        live_baseline=baseline,
        live_canary=latest,
    )


def _unattested(stats: LiveStats) -> str:
    """Said in the reason, so a canary blinded by a server that does not sign its responses
    (or by clients that drop the ids) is seen, not trusted."""
    if not stats.unattested:
        return ""
    return (
        f"; {stats.unattested} traces not counted: their response ids are not signed for the "
        "version they claim"
    )


def _rate(stats: LiveStats) -> str:
    return "n/a" if stats.success_rate is None else f"{stats.success_rate * 100:.1f}%"

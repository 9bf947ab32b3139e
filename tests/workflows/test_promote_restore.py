"""A restore that fails does not fail the promotion workflow (issue 43, item 7).

PromoteWorkflow on a real Temporal dev server, with activity fakes typed by the real
payloads: every deploy is refused (as proof of delivery refuses one), the candidate's and
then the restore of the previous champion. On main the restore's failure failed the whole
workflow; now the promotion ends ``failed`` and says that the restore failed too.
"""

from __future__ import annotations

import concurrent.futures
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from services.loop.policies import ServingTarget
from services.loop.states import PromotionStatus
from workflows.payloads.promote import (
    DeployInput,
    DeployResult,
    LiveStats,
    LiveStatsInput,
    PromoteInput,
    PromotionStatusInput,
)
from workflows.promote import PromoteWorkflow


class Refusing:
    """A serving target whose every deploy fails its proof of delivery."""

    def __init__(self) -> None:
        self.deploys: list[str] = []
        self.statuses: list[PromotionStatusInput] = []

    @activity.defn(name="deploy_checkpoint")
    def deploy_checkpoint(self, input: DeployInput) -> DeployResult:
        self.deploys.append(input.purpose)
        raise ApplicationError(
            f"delivery not proven for {input.checkpoint_id}",
            type="DeliveryNotProven",
            non_retryable=True,
        )

    @activity.defn(name="live_stats")
    def live_stats(self, input: LiveStatsInput) -> LiveStats:
        return LiveStats(n=0, successes=0, success_rate=None)

    @activity.defn(name="update_promotion")
    def update_promotion(self, input: PromotionStatusInput) -> None:
        self.statuses.append(input)


async def test_a_failed_restore_is_said_on_the_promotion(
    temporal_client: Client, task_queue: str
) -> None:
    target = Refusing()
    input = PromoteInput(
        loop="bot",
        cycle=1,
        promotion_id=1,
        candidate_checkpoint_id="candidate-ck",
        candidate_uri="file:///candidate",
        previous_checkpoint_id="champion-ck",
        previous_uri="file:///champion",
        serving_target=ServingTarget(kind="local"),
        canary_seconds=1,
        canary_check_interval_s=0.5,
        canary_min_traces=1,
        canary_max_drop_points=5,
    )
    async with Worker(
        temporal_client,
        task_queue=task_queue,
        workflows=[PromoteWorkflow],
        activities=[target.deploy_checkpoint, target.live_stats, target.update_promotion],
        activity_executor=concurrent.futures.ThreadPoolExecutor(2),
    ):
        result = await temporal_client.execute_workflow(
            PromoteWorkflow.run,
            input,
            id=f"loop/bot/cycle/1/promote-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )

    assert target.deploys == ["candidate", "restore"]
    assert result.status == PromotionStatus.FAILED
    assert result.reason.startswith("deploy of the candidate failed: DeliveryNotProven: ")
    assert "; restoring the previous champion champion-ck failed too: " in result.reason
    assert [s.status for s in target.statuses] == [
        PromotionStatus.DEPLOYING,
        PromotionStatus.FAILED,
    ]
    assert target.statuses[-1].reason == result.reason

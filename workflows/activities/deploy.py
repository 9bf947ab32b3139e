"""Activities that change what a loop serves: a promotion's deploy (or the restore of the
champion), and an operator's rollback (plan, deploy, record).

**No deploy holds a row lock.** A deploy is slow (a rollout, a model load: minutes) and
external, so each one runs in three steps: (1) a short transaction reads, and where it must
checks under the loop's row lock, what the deploy may do, then commits; (2) the deploy runs
with no transaction open; (3) a new short transaction records how it ended (the serving
ledger's sample, the proof of delivery; for a rollback, the champion and the promotion,
under the row lock again). Holding the lock through step 2 would stall every writer of the
loop's row (a cycle's start and close, the api's config updates, the ledger's samples) for
the length of a rollout.

**What guards against two deploys** once the lock is released: a loop's deploys all run from
its one workflow (``loop/<name>``), which runs one cycle at a time, promotes through a child
whose id derives from the cycle, and handles an operator's rollback between cycles; a retried
activity deploys the same version, which every serving target treats as a no-op; and a
promotion's deploy is checked against the champion under the row lock
(:func:`_refuse_slipping_back`), so a stale cycle (a restarted loop replaying old records)
cannot move serving backwards. A rollback's record re-reads the promotion under the lock, so
a retry after a recorded rollback changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.orm import Session
from temporalio import activity
from temporalio.exceptions import ApplicationError

from services.db.models import Cycle, Loop
from services.db.queries import cycles as q
from services.db.queries.loops import require_loop, serving_targets_of_other_loops
from services.db.queries.runs import require_checkpoint
from services.db.session import SessionFactory
from services.logs import log_context
from services.loop.policies import RECORDED, ServingTarget
from services.loop.promotions import rollback_promotion
from services.loop.states import Decision, PromotionStatus
from services.metrics import LOOP_PROMOTIONS
from services.serving.base import ServingError
from services.serving.names import loop_serving_the_same_name, name_taken_message
from workflows.activities.delivery import Delivery
from workflows.activities.serving_ledger import ServingSampler
from workflows.activities.transactions import (
    loop_cycle,
    serving_failure,
    serving_mapping,
    transaction,
    utcnow,
)
from workflows.payloads.promote import DeployInput, DeployResult
from workflows.payloads.rollback import (
    FinishRollbackInput,
    RollbackInput,
    RollbackPlan,
    RollbackResult,
)

logger = logging.getLogger(__name__)


class ServingDeployer(Protocol):
    """Deploys a checkpoint to a loop's serving target and returns the version now served."""

    def __call__(
        self, serving_target: dict[str, Any], checkpoint_id: str, checkpoint_uri: str
    ) -> str: ...


class DeployActivities:
    """Deploys and rollbacks; the serving target, the ledger and the prover come in."""

    def __init__(
        self,
        session_factory: SessionFactory,
        deploy: ServingDeployer,
        sampler: ServingSampler,
        delivery: Delivery,
    ) -> None:
        self._sessions = session_factory
        self._deploy = deploy
        self._sampler = sampler
        self._delivery = delivery

    @activity.defn(name="deploy_checkpoint")
    def deploy_checkpoint(self, input: DeployInput) -> DeployResult:
        """Deploying the version already served is a no-op for every serving target.

        A promotion's deploy names its cycle, and is refused (non-retryable) when it would
        let serving slip back: see :func:`_refuse_slipping_back`. The check commits before
        the deploy starts (the module's docstring says why that is safe).
        """
        with transaction(self._sessions) as session:
            _refuse_a_shared_name(session, input)
            if input.cycle is not None:
                _refuse_slipping_back(session, input)
        served = self._deploy_verified(
            input.loop, input.serving_target, input.checkpoint_id, input.checkpoint_uri
        )
        if served != input.checkpoint_id:
            raise ApplicationError(
                f"the serving target reports version {served!r} after deploying "
                f"{input.checkpoint_id!r}",
                type="DeployNotVerified",
            )
        self._sampler.sample(input.loop, served, input.serving_target)
        proof = self._delivery.prove(input)
        return DeployResult(
            served_version=served, deployed_at=utcnow().isoformat(), delivery=proof.note
        )

    @activity.defn(name="rollback_champion")
    def rollback_champion(self, input: RollbackInput) -> RollbackResult:
        """Operator rollback in one activity, as LoopWorkflow ran it before its
        rollback-deploy patch (kept for those histories): plan, deploy, record, each step as
        :meth:`plan_rollback`, ``deploy_checkpoint`` and :meth:`finish_rollback` do it, so
        the deploy never holds the loop's row lock and a failed one is recorded, not raised.
        """
        plan = self.plan_rollback(input)
        if plan.promotion_id is None or plan.checkpoint_id is None:
            return RollbackResult(False, plan.reason)
        error: str | None = None
        try:
            served = self._deploy_verified(
                input.loop, plan.serving_target, plan.checkpoint_id, plan.checkpoint_uri or ""
            )
            if served != plan.checkpoint_id:
                error = f"serving {served!r} after the deploy, expected {plan.checkpoint_id!r}"
            else:
                self._sampler.sample(input.loop, served, plan.serving_target)
                self._delivery.prove(
                    DeployInput(
                        input.loop,
                        plan.serving_target,
                        plan.checkpoint_id,
                        plan.checkpoint_uri or "",
                        purpose="rollback",
                    )
                )
        except ApplicationError as exc:
            error = str(exc)
        return self.finish_rollback(
            FinishRollbackInput(
                input.loop, input.reason, plan.promotion_id, plan.checkpoint_id, error
            )
        )

    @activity.defn(name="plan_rollback")
    def plan_rollback(self, input: RollbackInput) -> RollbackPlan:
        """Read-only: the held promotion to undo and the checkpoint to serve again. The
        deploy runs after this transaction, never inside it (a rollout takes minutes)."""
        with log_context(loop=input.loop), transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop)
            promotion = q.last_held_promotion(session=session, loop=loop)
            if promotion is None or promotion.previous_checkpoint_id is None:
                return RollbackPlan(None, "no promotion to roll back")
            previous = require_checkpoint(
                session=session, checkpoint_id=promotion.previous_checkpoint_id
            )
            return RollbackPlan(
                promotion.id,
                checkpoint_id=previous.id,
                checkpoint_uri=previous.uri,
                serving_target=ServingTarget.model_validate(
                    loop.serving_target or {}, context=RECORDED
                ),
            )

    @activity.defn(name="finish_rollback")
    def finish_rollback(self, input: FinishRollbackInput) -> RollbackResult:
        """Record how the rollback's deploy ended, on the loop's row lock.

        Served: the promotion is rolled back and the previous champion is the champion again.
        Failed: a ``rollback`` promotion row with status ``failed`` and the error says so
        (the dashboard's events and ``GET /v1/loops/{loop}/status`` show it); the champion
        and the held promotion stay as they were. Idempotent: a retry finds the promotion
        rolled back already, or the same failure recorded.
        """
        with log_context(loop=input.loop), transaction(self._sessions) as session:
            loop = require_loop(session=session, name=input.loop, for_update=True)
            promotion = q.get_promotion(session=session, promotion_id=input.promotion_id)
            if input.error is not None:
                return _record_failed_rollback(session, loop, input)
            if promotion.status == PromotionStatus.HELD:
                q.update_promotion(
                    session=session,
                    promotion_id=promotion.id,
                    status=PromotionStatus.ROLLED_BACK,
                    reason=f"rolled back by operator: {input.reason}",
                    set_champion=input.checkpoint_id,
                    timestamp_field="rolled_back_at",
                )
                session.add(
                    rollback_promotion(
                        loop,
                        from_checkpoint_id=promotion.candidate_checkpoint_id,
                        to_checkpoint_id=input.checkpoint_id,
                        reason=input.reason,
                        failed=False,
                        now=utcnow(),
                    )
                )
                LOOP_PROMOTIONS.labels(input.loop, Decision.ROLLBACK).inc()
            return RollbackResult(
                True, f"serving {input.checkpoint_id} again: {input.reason}", input.checkpoint_id
            )

    def _deploy_verified(
        self, loop: str, serving_target: ServingTarget, checkpoint_id: str, checkpoint_uri: str
    ) -> str:
        """Deploy; a serving error is retried only when the target says a retry can help."""
        try:
            with log_context(loop=loop):
                return self._deploy(serving_mapping(serving_target), checkpoint_id, checkpoint_uri)
        except ServingError as exc:
            raise serving_failure(exc) from exc

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.deploy_checkpoint,
            self.rollback_champion,
            self.plan_rollback,
            self.finish_rollback,
        ]


def _record_failed_rollback(
    session: Session, loop: Loop, input: FinishRollbackInput
) -> RollbackResult:
    """A rollback whose deploy failed, recorded once (a retry finds the same reason)."""
    reason = (
        f"rollback to {input.checkpoint_id} failed ({input.reason}): {input.error}; "
        f"the champion is still {loop.champion_checkpoint_id}"
    )
    if not q.has_rollback_record(
        session=session, loop=loop, status=PromotionStatus.FAILED, reason=reason
    ):
        session.add(
            rollback_promotion(
                loop,
                from_checkpoint_id=loop.champion_checkpoint_id,
                to_checkpoint_id=input.checkpoint_id,
                reason=reason,
                failed=True,
                now=utcnow(),
            )
        )
    logger.warning("loop %s: %s", input.loop, reason)
    return RollbackResult(False, reason)


def _refuse_a_shared_name(session: Session, input: DeployInput) -> None:
    """Refuse a deploy under a model name another loop serves under on the same server (a
    loop saved before the api checked it): see services.serving.names."""
    target = serving_mapping(input.serving_target)
    others = serving_targets_of_other_loops(session=session, except_name=input.loop)
    other = loop_serving_the_same_name(target, others)
    if other is not None:
        raise ApplicationError(
            f"refusing to deploy for loop {input.loop!r}: {name_taken_message(target, other)}",
            type="ServedNameTaken",
            non_retryable=True,
        )


def _refuse_slipping_back(session: Session, input: DeployInput) -> None:
    """Refuse a promotion's deploy that would move serving backwards (a restarted loop
    replaying an old cycle's records).

    A candidate deploy must be the cycle's own candidate, from the loop's newest cycle,
    trained from the champion serving now and not older than it; a restore must put back
    the champion itself. The check reads the champion under the loop's row lock, so it is
    serialized with every change of the champion (a rollback's record, a champion
    registered by hand, a cycle's start); the lock ends with this transaction, before the
    deploy.
    """
    assert input.cycle is not None
    loop, cycle = loop_cycle(session, input.loop, input.cycle, for_update=True)
    problem = _slip_back_problem(session, loop, input, cycle)
    if problem is not None:
        raise ApplicationError(
            f"refusing to deploy for loop {input.loop!r}: {problem}",
            type="StaleCheckpoint",
            non_retryable=True,
        )


def _slip_back_problem(
    session: Session, loop: Loop, input: DeployInput, cycle: Cycle
) -> str | None:
    """What makes the deploy a step backwards, or None when it is not one."""
    champion_id = loop.champion_checkpoint_id
    if input.purpose == "restore":
        if champion_id is not None and input.checkpoint_id != champion_id:
            return f"restoring {input.checkpoint_id!r}, but the champion is {champion_id!r}"
        return None
    return _stale_candidate(session, loop, input.checkpoint_id, cycle)


def _stale_candidate(session: Session, loop: Loop, checkpoint_id: str, cycle: Cycle) -> str | None:
    """Why a candidate deploy is stale: not the cycle's candidate, not the newest cycle's,
    trained from another champion than the one serving, or older than it."""
    champion_id = loop.champion_checkpoint_id
    if cycle.candidate_checkpoint_id != checkpoint_id:
        return (
            f"{checkpoint_id!r} is not cycle {cycle.number}'s candidate "
            f"({cycle.candidate_checkpoint_id!r})"
        )
    if (latest := q.last_cycle_number(session=session, loop=loop)) > cycle.number:
        return f"cycle {cycle.number} is not the loop's newest cycle ({latest} is)"
    if champion_id is None:
        return None
    if cycle.champion_checkpoint_id != champion_id:
        return (
            f"cycle {cycle.number} trained from {cycle.champion_checkpoint_id!r}, but the "
            f"champion is now {champion_id!r}"
        )
    candidate = require_checkpoint(session=session, checkpoint_id=checkpoint_id)
    champion = require_checkpoint(session=session, checkpoint_id=champion_id)
    if candidate.id != champion.id and candidate.created_at < champion.created_at:
        return f"{candidate.id!r} is older than the champion {champion.id!r}"
    return None

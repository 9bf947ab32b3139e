"""Promotion rows an operator's action writes: a rollback (done or failed) and a champion
registered by hand.

A cycle's own decision is inserted once per cycle by ``services.db.queries.cycles.
record_decision`` (its unique key makes a retry a no-op); every other row of the
``promotions`` table is built here, so each says the same things the same way: no cycle,
decided by the operator, the serving target the loop had when it was written.
"""

from __future__ import annotations

import datetime as dt

from services.db.models import Loop, Promotion
from services.loop.states import Decision, PromotionStatus


def operator_promotion(
    loop: Loop,
    *,
    decision: Decision,
    status: PromotionStatus,
    reason: str,
    candidate_checkpoint_id: str | None,
    previous_checkpoint_id: str | None,
    now: dt.datetime,
) -> Promotion:
    """A promotion row of no cycle, decided by the operator; a rolled-back one is stamped
    ``rolled_back_at``. The caller adds it to its session (and owns the transaction)."""
    return Promotion(
        loop_id=loop.id,
        cycle_id=None,
        decision=decision,
        status=status,
        reason=reason,
        candidate_checkpoint_id=candidate_checkpoint_id,
        previous_checkpoint_id=previous_checkpoint_id,
        serving_target=loop.serving_target,
        decided_by="operator",
        rolled_back_at=now if status == PromotionStatus.ROLLED_BACK else None,
    )


def rollback_promotion(
    loop: Loop,
    *,
    from_checkpoint_id: str | None,
    to_checkpoint_id: str,
    reason: str,
    failed: bool,
    now: dt.datetime,
) -> Promotion:
    """The record of an operator rollback from one checkpoint to another: ``rolled_back``
    when the previous champion serves again, ``failed`` when its deploy did not happen
    (the champion stays, and the row's reason says why)."""
    return operator_promotion(
        loop,
        decision=Decision.ROLLBACK,
        status=PromotionStatus.FAILED if failed else PromotionStatus.ROLLED_BACK,
        reason=reason,
        candidate_checkpoint_id=to_checkpoint_id,
        previous_checkpoint_id=from_checkpoint_id,
        now=now,
    )

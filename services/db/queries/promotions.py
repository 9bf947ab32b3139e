"""The loop's promotions as the pages and the demo read them: each decision with its cycle
number and what followed (deployed, canary ended, rolled back). Never commits.

The gate's writes (record_decision, update_promotion, ...) stay with the cycle they belong
to in services.db.queries.cycles; this is the read side, one query for every reader.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.db.models import Cycle, Promotion
from services.loop.states import Decision, PromotionStatus


@dataclass(frozen=True)
class PromotionRow:
    """One promotion, rollback or rejection, with the number of its cycle (None: an
    operator's registration or rollback)."""

    id: int
    cycle_number: int | None
    decision: str
    status: str
    reason: str
    candidate_checkpoint_id: str | None
    previous_checkpoint_id: str | None
    decided_at: dt.datetime
    deployed_at: dt.datetime | None
    canary_ended_at: dt.datetime | None
    rolled_back_at: dt.datetime | None

    @property
    def promoted(self) -> bool:
        """Whether the candidate was put in service (it may have been rolled back since)."""
        return self.decision == Decision.PROMOTE and self.status not in (
            PromotionStatus.REJECTED,
            PromotionStatus.FAILED,
        )

    @property
    def rolled_back(self) -> bool:
        """An operator's rollback, or a promotion the canary rolled back."""
        return self.decision == Decision.ROLLBACK or self.rolled_back_at is not None


def loop_promotions(
    *, session: Session, loop_id: int, held_by_cycles: bool = False
) -> list[PromotionRow]:
    """The loop's promotions, oldest decision first; ``held_by_cycles``: only the cycles'
    promotions whose candidate still held after its canary (not the operator's champion)."""
    statement = (
        select(Promotion, Cycle.number)
        .outerjoin(Cycle, Cycle.id == Promotion.cycle_id)
        .where(Promotion.loop_id == loop_id)
        .order_by(Promotion.decided_at, Promotion.id)
    )
    if held_by_cycles:
        statement = statement.where(
            Promotion.status == PromotionStatus.HELD, Promotion.cycle_id.is_not(None)
        )
    return [_row(promotion, number) for promotion, number in session.execute(statement)]


def _row(promotion: Promotion, number: int | None) -> PromotionRow:
    return PromotionRow(
        id=promotion.id,
        cycle_number=number,
        decision=promotion.decision,
        status=promotion.status,
        reason=promotion.reason or "",
        candidate_checkpoint_id=promotion.candidate_checkpoint_id,
        previous_checkpoint_id=promotion.previous_checkpoint_id,
        decided_at=promotion.decided_at,
        deployed_at=promotion.deployed_at,
        canary_ended_at=promotion.canary_ended_at,
        rolled_back_at=promotion.rolled_back_at,
    )

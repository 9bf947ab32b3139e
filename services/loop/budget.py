"""The budget rule: a loop with a budget stops spending once it is spent.

Two moments apply it. Before a cycle, ``services.loop.estimate`` refuses a cycle whose
estimate exceeds what is left; after a cycle, :func:`settle_budget` pauses the loop when its
runs have spent the budget. Either way the loop is *paused* with the reason, never archived
or failed: an operator raises the budget and resumes it, and nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy.orm import Session

from services.db.models import Loop
from services.db.queries.cycles import LoopLedger, loop_ledger
from services.loop.states import LoopLifecycle


@dataclass(frozen=True)
class BudgetCheck:
    """The loop's cumulative ledger and whether its budget is spent."""

    ledger: LoopLedger
    exhausted: bool


def budget_usd(loop: Loop) -> float | None:
    """The loop's budget in dollars (None: no budget)."""
    return float(loop.budget_usd) if loop.budget_usd is not None else None


def pause_for_budget(loop: Loop, reason: str) -> None:
    """Pause an active loop for its budget's sake, saying why; a paused or archived loop
    keeps its status and reason (an operator's pause is not overwritten)."""
    if loop.status == LoopLifecycle.ACTIVE:
        loop.status = LoopLifecycle.PAUSED
        loop.status_reason = reason


def settle_budget(*, session: Session, loop: Loop) -> BudgetCheck:
    """After a cycle's runs are accounted: the loop's ledger, and the loop paused when the
    budget is spent. The caller holds the loop's row lock and owns the transaction; pending
    changes are flushed first so the ledger counts them."""
    session.flush()
    ledger = loop_ledger(session=session, loop=loop)
    exhausted = loop.budget_usd is not None and Decimal(str(ledger.spent_usd)) >= loop.budget_usd
    if exhausted:
        pause_for_budget(
            loop,
            f"budget of ${loop.budget_usd:.2f} spent (${ledger.spent_usd:.2f}); raise the budget "
            "and resume",
        )
    return BudgetCheck(ledger, exhausted)

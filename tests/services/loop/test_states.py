"""The loop's StrEnums are their stored strings, and list what the database allows."""

from __future__ import annotations

import enum
import re

import pytest

from services.db.models import Base
from services.loop.states import (
    CycleOutcome,
    CycleStage,
    Decision,
    LoopLifecycle,
    PromotionStatus,
    RunStatus,
)


def allowed(table: str, column: str) -> set[str]:
    """The values a check constraint ``<column> IN (...)`` of a table allows."""
    for constraint in Base.metadata.tables[table].constraints:
        text = str(getattr(constraint, "sqltext", ""))
        if text.startswith(f"{column} IN"):
            return set(re.findall(r"'([^']+)'", text))
    raise AssertionError(f"no check constraint on {table}.{column}")


@pytest.mark.parametrize(
    ("states", "table", "column"),
    [
        (LoopLifecycle, "loops", "status"),
        (RunStatus, "runs", "status"),
        (Decision, "promotions", "decision"),
        (PromotionStatus, "promotions", "status"),
    ],
)
def test_each_enum_lists_exactly_what_its_column_allows(
    states: type[enum.StrEnum], table: str, column: str
) -> None:
    assert {state.value for state in states} == allowed(table, column)


def test_a_member_is_its_stored_string() -> None:
    assert CycleOutcome.PROMOTED == "promoted"
    assert f"{CycleStage.AWAITING_APPROVAL}" == "awaiting_approval"
    assert RunStatus("succeeded") is RunStatus.SUCCEEDED
    assert {"held": 1}[PromotionStatus.HELD] == 1


def test_a_run_ends_in_a_terminal_status_only() -> None:
    assert {status for status in RunStatus if status.terminal} == {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.LOST,
    }


def test_an_unknown_word_is_refused() -> None:
    with pytest.raises(ValueError, match="'finished' is not a valid RunStatus"):
        RunStatus("finished")

"""What the worker records of a succeeded job's outputs beyond its run row, in one place:

- its listed episodes, as demonstrations of their tasks (:mod:`.demonstrations`);
- a replay job's sandbox outcomes: its live tool answers into the loop's tool-response
  store, and the tasks nobody could answer set aside (:mod:`.tool_outcomes`).

Each trusts the job's files only as far as its ``metrics.json`` listing vouches for them and
puts what it refused on the run (``runs.error``); the run's own outcome stands. And each is
recorded in a savepoint of its own (:func:`record_auxiliary`): whatever else goes wrong (a
row Postgres refuses, a bug) is logged and said on the run too, never raised. Raising
would fail the activity and, retried, the cycle's train stage: the demo's first cycle
failed that way on a row Postgres refused (issue 43).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.chat.text import valid_text
from services.curation.demonstrations import record_job_episodes
from services.curation.tool_outcomes import record_job_tool_outcomes
from services.db.models import Run
from services.settings import Settings

logger = logging.getLogger(__name__)


def record_job_outputs(
    session: Session, run: Run, output_dir: Path, metrics: Mapping[str, Any], settings: Settings
) -> None:
    """Record a succeeded run's episodes and sandbox outcomes (see the module); idempotent,
    as the activity that calls it (a retry finds every row already there)."""
    record_auxiliary(
        session,
        run,
        "demonstrations",
        lambda: record_job_episodes(
            session,
            run=run,
            output_dir=output_dir,
            metrics=metrics,
            per_task=settings.demonstrations_per_task,
        ),
    )
    record_auxiliary(
        session,
        run,
        "tool outcomes",
        lambda: record_job_tool_outcomes(
            session,
            run=run,
            output_dir=output_dir,
            metrics=metrics,
            tool_endpoints=settings.tool_endpoints,
        ),
    )


def record_auxiliary(session: Session, run: Run, what: str, record: Callable[[], object]) -> None:
    """Run ``record`` in a savepoint; whatever it raises is rolled back to the savepoint,
    logged and said on the run (``runs.error``), and the run's outcome stands."""
    try:
        with session.begin_nested():
            record()
    except Exception as exc:  # see the docstring: nothing here fails the run
        logger.exception("run %s: its %s were not recorded", run.id, what)
        note = valid_text(f"{what} not recorded: {type(exc).__name__}: {exc}")[:1000]
        run.error = f"{run.error}; {note}" if run.error else note

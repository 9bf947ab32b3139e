"""What the worker records of a succeeded job's outputs beyond its run row, in one place:

- its listed episodes, as demonstrations of their tasks (:mod:`.demonstrations`);
- a replay job's sandbox outcomes: its live tool answers into the loop's tool-response
  store, and the tasks nobody could answer set aside (:mod:`.tool_outcomes`).

Each trusts the job's files only as far as its ``metrics.json`` listing vouches for them and
puts what it refused on the run (``runs.error``); the run's own outcome stands.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.curation.demonstrations import record_job_episodes
from services.curation.tool_outcomes import record_job_tool_outcomes
from services.db.models import Run
from services.settings import Settings


def record_job_outputs(
    session: Session, run: Run, output_dir: Path, metrics: Mapping[str, Any], settings: Settings
) -> None:
    """Record a succeeded run's episodes and sandbox outcomes (see the module); idempotent,
    as the activity that calls it (a retry finds every row already there)."""
    record_job_episodes(
        session,
        run=run,
        output_dir=output_dir,
        metrics=metrics,
        per_task=settings.demonstrations_per_task,
    )
    record_job_tool_outcomes(
        session,
        run=run,
        output_dir=output_dir,
        metrics=metrics,
        tool_endpoints=settings.tool_endpoints,
    )

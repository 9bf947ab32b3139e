"""The difficulty probe's two ends: the task file it runs on, and its results as pass rates.

When a loop's ``difficulty_filter`` is on, each cycle runs the champion ``probe_attempts``
times on the train tasks that have no ``probe_pass_rate`` yet (a ``probe`` run: an eval job
with ``samples`` set to the attempts). This module

- writes those tasks (:func:`export_unprobed`) to ``<run dir>/probe-tasks.jsonl`` in the
  ``ratchet.task/v1`` format of a dataset's files, ``metadata.ratchet`` included, once per
  run: a second call for the same run reads back the file the first one wrote;
- turns the job's ``results.jsonl`` into pass rates of tasks (:func:`pass_rates`), naming
  tasks by their task id exactly as recorded evaluations do
  (``queries.tasks.row_ids_by_job_task_id``).

Storing the rates is ``queries.tasks.record_probe_results``; the snapshot then filters.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore
from services.curation.difficulty import DifficultySelection, probe_counts, select_by_difficulty
from services.curation.policy import CurationPolicy
from services.curation.snapshot import task_lines
from services.db.queries import tasks as q
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.environments.base import TaskFileError, read_task_file, write_task_file

logger = logging.getLogger(__name__)

PROBE_TASK_FILE = "probe-tasks.jsonl"


class ProbeError(Exception):
    """A probe that cannot succeed by retrying (unknown loop, unreadable file or results)."""


@dataclass(frozen=True)
class ProbeExport:
    """The probe run's task file and the task ids it holds (no file when nothing to probe)."""

    path: Path | None
    task_ids: list[int]


@dataclass(frozen=True)
class ProbeRates:
    """Pass rates by task id, and how the difficulty filter will treat them."""

    pass_rates: dict[int, float]
    selection: DifficultySelection


def export_unprobed(
    session_factory: SessionFactory,
    store: ArtifactStore,
    *,
    loop_name: str,
    run_id: str,
    max_tasks: int,
) -> ProbeExport:
    """Write the loop's newest unprobed train tasks to the run's task file (see the module).

    At most ``max_tasks`` and the policy's ``max_train_tasks`` tasks. Written to a temporary
    file and renamed into place, so a reader never sees half a file.
    """
    if max_tasks < 1:
        raise ProbeError(f"max_tasks must be at least 1, got {max_tasks}")
    path = store.run_dir(loop_name, run_id) / PROBE_TASK_FILE
    if path.is_file():
        return ProbeExport(path, _task_ids_in(path))
    with session_factory.begin() as session:
        try:
            loop = require_loop(session=session, name=loop_name)
        except NotFound as exc:
            raise ProbeError(str(exc)) from None
        policy = CurationPolicy.from_json(loop.curation_policy)
        limit = min(max_tasks, policy.max_train_tasks)
        members = q.unprobed_train_members(session=session, loop_id=loop.id, limit=limit)
        if not members:
            return ProbeExport(None, [])
        members = sorted(members, key=lambda m: m.dedup_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{PROBE_TASK_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write_task_file(staging, task_lines(session, members, "train"))
            try:
                # Never replace: a concurrent attempt that linked first wrote the run's input.
                os.link(staging, path)
            except FileExistsError:
                return ProbeExport(path, _task_ids_in(path))
        finally:
            staging.unlink(missing_ok=True)
    logger.info("probe %s of loop %s: %d unprobed train tasks", run_id, loop_name, len(members))
    return ProbeExport(path, [m.task_id for m in members])


def pass_rates(
    session: Session,
    *,
    loop_id: int,
    rows: Iterable[Mapping[str, Any]],
    task_ids: Sequence[int],
) -> ProbeRates:
    """The probe job's result rows as pass rates of the tasks it was given (``task_ids``).

    Raises :class:`ProbeError` when a row is malformed or names a task that was not given:
    such results are not the probe of these tasks, and storing them would be wrong. A given
    task with no row stays unprobed.
    """
    try:
        counts = probe_counts(rows)
    except ValueError as exc:
        raise ProbeError(f"probe results: {exc}") from exc
    ids = q.row_ids_by_job_task_id(
        session=session, loop_id=loop_id, job_task_ids=counts, among=task_ids
    )
    unknown = sorted(set(counts) - set(ids))
    if unknown:
        raise ProbeError(
            f"probe results name {len(unknown)} task(s) that were not probed, "
            f"e.g. {unknown[0][:12]}"
        )
    rates = {ids[spec]: count.pass_rate for spec, count in counts.items()}
    if len(rates) < len(task_ids):
        logger.warning(
            "probe results cover %d of %d tasks; the rest stay unprobed",
            len(rates),
            len(task_ids),
        )
    return ProbeRates(rates, select_by_difficulty(rates))


def _task_ids_in(path: Path) -> list[int]:
    """The task ids (``metadata.ratchet.task_id``) of a task file written by this module."""
    try:
        tasks = read_task_file(path)
    except (OSError, TaskFileError) as exc:
        raise ProbeError(f"probe task file {path} is unreadable: {exc}; remove it") from exc
    ids: list[int] = []
    for task in tasks:
        lineage = task.metadata.get("ratchet")
        task_id = lineage.get("task_id") if isinstance(lineage, dict) else None
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise ProbeError(f"probe task file {path} has a task without metadata.ratchet.task_id")
        ids.append(task_id)
    return ids

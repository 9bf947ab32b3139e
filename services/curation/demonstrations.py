"""Demonstrations: every verified episode a probe or a training run found, kept for the
next cycle (issue 26, "keep every success"; docs/design.md, "Demonstrations").

The worker's two ends of it:

- :func:`record_job_episodes` — after a probe or train job, the episodes its
  ``episodes.jsonl`` holds become ``demonstrations`` rows of their tasks, but only as far
  as the job's ``metrics.json`` listing vouches for the file (name, bytes, sha256, count,
  declared kinds; :func:`services.training.episode_file.read_listed_episodes`) and only
  for train-split tasks of the loop (the run's dataset for a train run): anything else is
  refused whole, and the reason is recorded on the run (``runs.error``) while the run's
  own outcome stands. At most ``Settings.demonstrations_per_task`` successes and as many
  failures of a task are kept, the newest.
- :func:`train_job_inputs` — before a train job, its dataset's stored episodes are written
  to ``<run dir>/demonstrations.jsonl`` (once per run: a retry reads the same file) and the
  spec gets ``demonstrations`` (that path) and ``keep_episodes``; rft trains on the stored
  successes, dpo pairs them with failures of the same task.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.db.models import Demonstration, Run
from services.db.queries import demonstrations as q
from services.db.queries.tasks import row_ids_by_job_task_id
from services.training.episode_file import (
    DEMONSTRATIONS_FILE,
    EpisodeFileError,
    EpisodeRecord,
    read_listed_episodes,
    write_demonstrations,
)

logger = logging.getLogger(__name__)

KEPT_RUN_KINDS = ("probe", "train")


def record_job_episodes(
    session: Session, *, run: Run, output_dir: Path, metrics: Mapping[str, Any], per_task: int
) -> int:
    """Record a finished run's listed episodes as demonstrations (see the module); how many
    rows were new. A file its listing does not vouch for, or episodes of tasks that are not
    the run's train tasks, store nothing and put the reason on ``run.error``."""
    if run.kind not in KEPT_RUN_KINDS or per_task < 1 or "episode_file" not in metrics:
        return 0
    try:
        records = read_listed_episodes(output_dir, metrics)
        task_ids = _task_rows(session, run, records)
    except EpisodeFileError as exc:
        message = f"episodes rejected, none stored: {exc}"
        run.error = f"{run.error}; {message}" if run.error else message
        logger.warning("run %s: %s", run.id, message)
        return 0
    rows = [
        q.NewDemonstration(
            task_id=task_ids[record.task_id],
            task_hash=record.task_id,
            sample=index,
            passed=record.passed,
            reward=record.reward,
            text=record.text,
            tokens=record.tokens,
            sequences=[[ids, mask] for ids, mask in record.sequences],
            checkpoint_id=record.checkpoint_id,
            family=record.family,
        )
        for index, record in _within_bound(records, per_task)
    ]
    inserted = q.record_demonstrations(
        session=session,
        loop_id=run.loop_id,
        run_id=run.id,
        source=run.kind,
        rows=rows,
        per_task=per_task,
    )
    logger.info("run %s: %d of %d episodes stored as demonstrations", run.id, inserted, len(rows))
    return inserted


def _within_bound(
    records: Sequence[EpisodeRecord], per_task: int
) -> list[tuple[int, EpisodeRecord]]:
    """The records (with their line numbers) within ``per_task`` successes and failures of
    each task, in file order: a run never stores more than the bound, so recording it again
    finds every row already there."""
    seen: dict[tuple[str, bool], int] = {}
    kept: list[tuple[int, EpisodeRecord]] = []
    for index, record in enumerate(records):
        key = (record.task_id, record.passed)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= per_task:
            kept.append((index, record))
    return kept


def _task_rows(session: Session, run: Run, records: Sequence[EpisodeRecord]) -> dict[str, int]:
    """``{task hash: row id}`` of the records' tasks; EpisodeFileError when one is not a
    train-split task of the run's loop (and of its dataset, for a train run)."""
    hashes = {record.task_id for record in records}
    dataset_id = run.dataset_id if run.kind == "train" else None
    ids = row_ids_by_job_task_id(
        session=session, loop_id=run.loop_id, job_task_ids=hashes, dataset_id=dataset_id
    )
    train = q.train_split_ids(session=session, loop_id=run.loop_id, task_ids=ids.values())
    foreign = sorted(h for h in hashes if ids.get(h) not in train)
    if foreign:
        raise EpisodeFileError(
            f"episodes name {len(foreign)} task(s) that are not train tasks of this run, "
            f"e.g. {foreign[0][:12]}"
        )
    return ids


def job_spec_keys(
    session: Session,
    *,
    kind: str,
    run_dir: Path,
    loop_id: int,
    dataset_id: int | None,
    per_task: int,
) -> dict[str, object]:
    """What a run's job spec gets beside its document: a probe's ``keep_episodes``, a train
    run's :func:`train_job_inputs`; nothing for other runs or when ``per_task`` is 0."""
    if per_task < 1 or kind not in KEPT_RUN_KINDS:
        return {}
    if kind == "probe":
        return {"keep_episodes": per_task}
    return train_job_inputs(
        session, run_dir=run_dir, loop_id=loop_id, dataset_id=dataset_id, per_task=per_task
    )


def train_job_inputs(
    session: Session, *, run_dir: Path, loop_id: int, dataset_id: int | None, per_task: int
) -> dict[str, object]:
    """The train spec's demonstration keys (see the module); none when ``per_task`` is 0.

    ``demonstrations`` is set only when the dataset's train tasks have stored episodes. The
    file is written once per run, so the spec a retried activity builds names the same
    bytes."""
    if per_task < 1:
        return {}
    keys: dict[str, object] = {"keep_episodes": per_task}
    path = run_dir / DEMONSTRATIONS_FILE
    if path.is_file():
        return {**keys, "demonstrations": str(path)}
    if dataset_id is None:
        return keys
    task_ids = q.train_task_ids(session=session, dataset_id=dataset_id)
    rows = q.demonstrations_for_tasks(session=session, loop_id=loop_id, task_ids=task_ids)
    if not rows:
        return keys
    count = write_demonstrations(path, (_record(row) for row in rows))
    logger.info("train run in %s reads %d stored demonstrations", run_dir, count)
    return {**keys, "demonstrations": str(path)}


def _record(row: Demonstration) -> EpisodeRecord:
    return EpisodeRecord(
        task_id=row.task_hash,
        passed=row.passed,
        reward=row.reward,
        text=row.text,
        sequences=[(list(ids), list(mask)) for ids, mask in row.sequences],
        checkpoint_id=row.checkpoint_id,
        family=row.family,
    )

"""Task rows of curation: the batch's bulk writes, LSH neighbours, splits, probes, listings.

Every function takes the session keyword-only and never commits. Bulk writes of a
curation batch are one statement per table: ``COPY`` for the rows it creates (tasks, their
sources and LSH bands: psycopg formats ``COPY`` rows in C, where an ``unnest`` of arrays
formats each element in Python) and ``unnest`` of arrays for the updates, so a batch of 500
traces costs a handful of round trips whatever its size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy import (
    BigInteger,
    BindParameter,
    String,
    any_,
    bindparam,
    func,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from services.db.models import DatasetTask, Loop, Task, TaskSource, Trace
from services.loop.states import BOOTSTRAP_TRIGGER

# Namespace of curation's advisory locks (the other key is the loop id).
_LOCK_NAMESPACE = 0x52434C  # "RCL"


# Length of an LSH bucket key (services.curation.similarity.band_keys: 4 uint32 rows).
_BUCKET_BYTES = 16


@dataclass(frozen=True)
class NeighbourRow:
    """A stored task sharing an LSH bucket with the batch."""

    task_id: int
    dedup_key: str
    cluster_id: str
    minhash: bytes
    verifier_json: str  # the verifier as jsonb text: decoded only when its key is not known


@dataclass(frozen=True)
class ExistingTask:
    task_id: int
    cluster_id: str
    split: str


def _ids(values: Sequence[int]) -> BindParameter[Any]:
    """One array parameter (``= ANY(:ids)``) instead of one parameter per id."""
    array: ARRAY[Any] = ARRAY(BigInteger)
    return bindparam(None, list(values), type_=array)


def _texts(values: Sequence[str]) -> BindParameter[Any]:
    array: ARRAY[Any] = ARRAY(String)
    return bindparam(None, list(values), type_=array)


def try_lock_loop_curation(*, session: Session, loop_id: int) -> bool:
    """Take the loop's curation lock for this transaction, without waiting.

    Batches of one loop run one at a time so every batch sees the tasks of the one before
    (near-duplicate matching needs that); batches of different loops run side by side.
    """
    locked = session.execute(
        text("SELECT pg_try_advisory_xact_lock(:namespace, :key)"),
        {"namespace": _LOCK_NAMESPACE, "key": loop_id % 2_147_483_647},
    ).scalar_one()
    return bool(locked)


def tasks_by_dedup_key(
    *, session: Session, loop_id: int, keys: Sequence[str]
) -> dict[str, ExistingTask]:
    """The loop's stored tasks among ``keys`` (exact duplicates of the batch's tasks)."""
    if not keys:
        return {}
    rows = session.execute(
        select(Task.content_hash, Task.id, Task.cluster_id, Task.split).where(
            Task.loop_id == loop_id, Task.content_hash == any_(_texts(keys))
        )
    ).all()
    return {row[0]: ExistingTask(row[1], row[2], row[3]) for row in rows}


def lsh_neighbours(
    *,
    session: Session,
    loop_id: int,
    bands: Sequence[tuple[int, bytes]],
    per_bucket: int,
) -> list[NeighbourRow]:
    """Stored tasks sharing any of ``bands``; at most ``per_bucket`` (the newest) per bucket.

    The cap bounds the work when one bucket grows very large (a boilerplate-heavy loop):
    such a bucket says little about similarity anyway, and the other bands still match.
    The buckets travel as one ``bytea`` (16 bytes each) and the bands as one ``int2``
    array's text, so the parameters cost the same to send whatever the batch size.
    """
    if not bands:
        return []
    distinct = sorted(set(bands))
    if any(len(bucket) != _BUCKET_BYTES for _, bucket in distinct):
        raise ValueError(f"LSH bucket keys must be {_BUCKET_BYTES} bytes")
    rows = session.execute(
        text(
            """
            WITH q AS (
                SELECT b.band,
                       substring(CAST(:buckets AS bytea)
                                 FROM CAST(b.n * 16 - 15 AS integer) FOR 16) AS bucket
                  FROM unnest(CAST(:bands AS integer[])) WITH ORDINALITY AS b(band, n)
            ), hit AS (
                SELECT DISTINCT b.task_id
                  FROM q
                  CROSS JOIN LATERAL (
                      SELECT lb.task_id FROM lsh_buckets AS lb
                       WHERE lb.loop_id = :loop_id AND lb.band = q.band AND lb.bucket = q.bucket
                       ORDER BY lb.task_id DESC
                       LIMIT :per_bucket
                  ) AS b
            )
            SELECT t.id, t.content_hash, t.cluster_id, t.minhash,
                   coalesce(CAST(t.spec -> 'verifier' AS text), '{}')
              FROM hit JOIN tasks AS t ON t.id = hit.task_id
             WHERE t.minhash IS NOT NULL
            """
        ),
        {
            "loop_id": loop_id,
            "bands": "{" + ",".join(str(band) for band, _ in distinct) + "}",
            "buckets": b"".join(bucket for _, bucket in distinct),
            "per_bucket": per_bucket,
        },
    ).all()
    return [NeighbourRow(row[0], row[1], row[2], bytes(row[3]), row[4]) for row in rows]


def cluster_splits(*, session: Session, loop_id: int, cluster_ids: Sequence[str]) -> dict[str, str]:
    """The train/eval/held-out split of each stored cluster among ``cluster_ids``.

    One index probe per cluster (``loop_id, cluster_id``), so the cost does not grow with the
    loop's task count. A cluster holding only regression tasks has no split yet.
    """
    if not cluster_ids:
        return {}
    rows = session.execute(
        text(
            """
            SELECT c.cluster_id, s.splits
              FROM unnest(CAST(:ids AS text[])) AS c(cluster_id)
              CROSS JOIN LATERAL (
                  SELECT array_agg(DISTINCT t.split) AS splits FROM tasks AS t
                   WHERE t.loop_id = :loop_id AND t.cluster_id = c.cluster_id
              ) AS s
             WHERE s.splits IS NOT NULL
            """
        ),
        {"loop_id": loop_id, "ids": list(cluster_ids)},
    ).all()
    out: dict[str, str] = {}
    for cluster_id, splits in rows:
        for split in ("train", "heldout", "eval"):
            if split in splits:
                out[cluster_id] = split
                break
    return out


def heldout_count(*, session: Session, loop_id: int) -> int:
    return int(
        session.execute(
            select(func.count()).where(Task.loop_id == loop_id, Task.split == "heldout")
        ).scalar_one()
    )


@dataclass(frozen=True)
class NewTaskRow:
    """A task a curation batch creates; ``spec_json`` is its spec, already encoded."""

    loop_id: int
    dedup_key: str  # stored in the ``content_hash`` column
    environment: str
    spec_json: str
    origin: str
    cluster_id: str
    split: str
    weight: int
    failure_signature: str | None
    redactions: Mapping[str, int]
    minhash: bytes | None


_TASK_COLUMNS = (
    "id, loop_id, content_hash, environment, spec, origin, cluster_id, split, weight,"
    " failure_signature, redactions, minhash"
)


def insert_tasks(*, session: Session, rows: Sequence[NewTaskRow]) -> dict[str, int]:
    """Insert task rows with ``COPY``; returns ``{dedup key: task id}``.

    Ids are drawn from the table's sequence first, one per row in row order, so they are
    the ids a multi-row ``INSERT`` would have given.
    """
    if not rows:
        return {}
    ids = sorted(
        session.execute(
            text(
                "SELECT nextval(pg_get_serial_sequence('tasks', 'id')) FROM generate_series(1, :n)"
            ),
            {"n": len(rows)},
        ).scalars()
    )
    with _copy(session, f"COPY tasks ({_TASK_COLUMNS}) FROM STDIN") as copy:
        for task_id, row in zip(ids, rows, strict=True):
            copy.write_row(
                (
                    task_id,
                    row.loop_id,
                    row.dedup_key,
                    row.environment,
                    row.spec_json,
                    row.origin,
                    row.cluster_id,
                    row.split,
                    row.weight,
                    row.failure_signature,
                    json.dumps(dict(row.redactions), separators=(",", ":")),
                    row.minhash,
                )
            )
    return {row.dedup_key: int(task_id) for task_id, row in zip(ids, rows, strict=True)}


@contextmanager
def _copy(session: Session, statement: str) -> Iterator[psycopg.Copy]:
    """``COPY ... FROM STDIN`` on the session's own connection, inside its transaction."""
    driver = session.connection().connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError("curation's bulk writes need the psycopg driver")
    with driver.cursor() as cursor, cursor.copy(statement) as copy:
        yield copy


def add_task_weights(*, session: Session, increments: Mapping[int, int]) -> None:
    """Raise the weight of kept tasks by the number of duplicates folded into them."""
    if not increments:
        return
    session.execute(
        text(
            """
            UPDATE tasks AS t SET weight = t.weight + v.inc
              FROM unnest(CAST(:ids AS bigint[]), CAST(:incs AS integer[])) AS v(id, inc)
             WHERE t.id = v.id
            """
        ),
        {"ids": list(increments), "incs": list(increments.values())},
    )


def insert_task_sources(*, session: Session, rows: Sequence[tuple[int, int, str]]) -> None:
    """Link tasks to the traces they came from: ``(task_id, trace_id, relation)``.

    The traces are this batch's own (locked, uncurated), so no row can exist already.
    """
    if not rows:
        return
    with _copy(session, "COPY task_sources (task_id, trace_id, relation) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)


def insert_lsh_buckets(
    *, session: Session, loop_id: int, rows: Sequence[tuple[int, bytes, int]]
) -> None:
    """Persist LSH bands: ``(band, bucket, task_id)`` for tasks of ``loop_id``.

    The tasks are this batch's new ones, so no row can exist already.
    """
    if not rows:
        return
    with _copy(session, "COPY lsh_buckets (loop_id, band, bucket, task_id) FROM STDIN") as copy:
        for band, bucket, task_id in rows:
            copy.write_row((loop_id, band, bucket, task_id))


def record_probe_results(*, session: Session, loop_id: int, pass_rates: Mapping[int, float]) -> int:
    """Store the champion's probe pass rate on tasks of a loop; returns rows updated."""
    if not pass_rates:
        return 0
    result = session.execute(
        text(
            """
            UPDATE tasks AS t SET probe_pass_rate = v.rate
              FROM unnest(CAST(:ids AS bigint[]), CAST(:rates AS double precision[]))
                   AS v(id, rate)
             WHERE t.id = v.id AND t.loop_id = :loop_id
            """
        ),
        {"ids": list(pass_rates), "rates": list(pass_rates.values()), "loop_id": loop_id},
    )
    return int(getattr(result, "rowcount", 0) or 0)


def pin_tasks(*, session: Session, loop_id: int, task_ids: Sequence[int]) -> list[int]:
    """Put tasks into the pinned regression suite (never trained on); returns ids changed.

    Held-out tasks cannot be pinned: the held-out set is frozen.
    """
    if not task_ids:
        return []
    result = session.execute(
        update(Task)
        .where(Task.loop_id == loop_id, Task.id.in_(list(task_ids)), Task.split != "heldout")
        .values(pinned=True, split="regression")
        .returning(Task.id)
    )
    return sorted(result.scalars().all())


def unpinnable_task_ids(*, session: Session, loop_id: int, task_ids: Sequence[int]) -> list[int]:
    """The ids of ``task_ids`` that :func:`pin_tasks` would refuse: not the loop's tasks, or
    held out (the held-out set is frozen); checked first, so a refused pin changes nothing."""
    pinnable = set(
        session.scalars(
            select(Task.id).where(
                Task.loop_id == loop_id, Task.id.in_(list(task_ids)), Task.split != "heldout"
            )
        )
    )
    return sorted(set(task_ids) - pinnable)


def list_tasks(
    *,
    session: Session,
    loop_id: int,
    split: str | None = None,
    set_aside: bool | None = None,
    limit: int = 50,
    before_id: int | None = None,
) -> list[Task]:
    """A loop's tasks, newest first (only those of ``split``, only those set aside or not);
    ``before_id`` (the last id of the previous page) pages on by keyset, which stays correct
    while curation adds tasks."""
    query = select(Task).where(Task.loop_id == loop_id)
    if split is not None:
        query = query.where(Task.split == split)
    if set_aside is not None:
        column = Task.set_aside_reason
        query = query.where(column.is_not(None) if set_aside else column.is_(None))
    if before_id is not None:
        query = query.where(Task.id < before_id)
    return list(session.scalars(query.order_by(Task.id.desc()).limit(limit)))


def task_sources(*, session: Session, task_id: int) -> list[tuple[int, str, str]]:
    """``(trace id, external id, relation)`` of every trace behind a task."""
    rows = session.execute(
        select(Trace.id, Trace.external_id, TaskSource.relation)
        .join(TaskSource, TaskSource.trace_id == Trace.id)
        .where(TaskSource.task_id == task_id)
        .order_by(Trace.id)
    ).all()
    return [(row[0], row[1], row[2]) for row in rows]


def count_new_train_tasks(*, session: Session, loop_id: int, difficulty_filter: bool = True) -> int:
    """Train tasks no cycle has trained on yet (and, with the filter on, that it would keep):
    those no dataset holds, or only datasets of bootstrap cycles, which hold the train split
    but learn from successes (a history's failures are the first regular cycle's work); and
    curated since the newest dataset a regular cycle trained on, whose ``max_train_tasks``
    sample left the others out on purpose (the next draw, a pure function of the tasks, would
    leave them out again: counting them started cycle after cycle on the same sample)."""
    return int(
        session.execute(
            text(
                """
                SELECT count(*) FROM tasks AS t
                 WHERE t.loop_id = :loop_id AND t.split = 'train' AND NOT t.pinned
                   AND t.set_aside_reason IS NULL
                   AND (NOT :filtered OR t.probe_pass_rate IS NULL
                        OR (t.probe_pass_rate > 0 AND t.probe_pass_rate < 1))
                   AND NOT EXISTS (
                       SELECT 1 FROM dataset_tasks AS d
                        WHERE d.task_id = t.id
                          AND NOT (
                              EXISTS (SELECT 1 FROM cycles AS c
                                       WHERE c.dataset_id = d.dataset_id
                                         AND c.trigger = :bootstrap)
                              AND NOT EXISTS (SELECT 1 FROM cycles AS c
                                               WHERE c.dataset_id = d.dataset_id
                                                 AND c.trigger <> :bootstrap)))
                   AND t.created_at > COALESCE(
                       (SELECT max(ds.created_at) FROM datasets AS ds
                          JOIN cycles AS c ON c.dataset_id = ds.id
                         WHERE c.loop_id = :loop_id AND c.trigger <> :bootstrap),
                       '-infinity'::timestamptz)
                """
            ),
            {"loop_id": loop_id, "filtered": difficulty_filter, "bootstrap": BOOTSTRAP_TRIGGER},
        ).scalar_one()
    )


def count_eval_tasks(*, session: Session, loop_id: int) -> int:
    """Eval tasks a snapshot can take (not pinned: pinned ones are regression tasks)."""
    return int(
        session.execute(
            select(func.count()).where(
                Task.loop_id == loop_id, Task.split == "eval", Task.pinned.is_(False)
            )
        ).scalar_one()
    )


@dataclass(frozen=True)
class SplitMember:
    """A task that may enter a dataset, without its spec (cheap to list by the thousand)."""

    task_id: int
    dedup_key: str
    weight: int
    probe_pass_rate: float | None
    pinned: bool
    cluster_id: str = ""


_MEMBER_COLUMNS = (
    Task.id,
    Task.content_hash,
    Task.weight,
    Task.probe_pass_rate,
    Task.pinned,
    Task.cluster_id,
)


def split_members(*, session: Session, loop_id: int, split: str) -> list[SplitMember]:
    """Candidates for one split of a dataset, newest first.

    ``train`` and ``eval`` exclude pinned tasks, and ``train`` the tasks set aside (never
    trained on, e.g. every episode needed a tool result nobody could give); ``regression`` is
    the regression split plus every pinned task, pinned ones first.
    """
    query = select(*_MEMBER_COLUMNS).where(Task.loop_id == loop_id)
    if split == "regression":
        query = query.where((Task.split == "regression") | Task.pinned.is_(True)).order_by(
            Task.pinned.desc(), Task.id.desc()
        )
    else:
        query = query.where(Task.split == split, Task.pinned.is_(False)).order_by(Task.id.desc())
    if split == "train":
        query = query.where(Task.set_aside_reason.is_(None))
    return [SplitMember(*row) for row in session.execute(query).all()]


def unprobed_train_members(*, session: Session, loop_id: int, limit: int) -> list[SplitMember]:
    """The newest ``limit`` train tasks (not pinned, not set aside) that have no probe pass
    rate yet."""
    query = (
        select(*_MEMBER_COLUMNS)
        .where(
            Task.loop_id == loop_id,
            Task.split == "train",
            Task.pinned.is_(False),
            Task.set_aside_reason.is_(None),
            Task.probe_pass_rate.is_(None),
        )
        .order_by(Task.id.desc())
        .limit(limit)
    )
    return [SplitMember(*row) for row in session.execute(query).all()]


def row_ids_by_job_task_id(
    *,
    session: Session,
    loop_id: int,
    job_task_ids: Iterable[str],
    dataset_id: int | None = None,
    among: Sequence[int] | None = None,
) -> dict[str, int]:
    """``{job task id: row id}`` of a loop's tasks, for the task ids job results name.

    Eval and probe results name a task by the task id of its spec (``spec.task_id``,
    :func:`services.environments.base.compute_task_id`), not by its row id nor by
    curation's dedup key. The lookup is scoped to the tasks the job was given: a dataset's
    tasks (``dataset_id``) or a list of row ids (``among``). Ids not found are simply absent
    from the result.
    """
    wanted = sorted(set(job_task_ids))
    if not wanted:
        return {}
    job_task_id = Task.spec["task_id"].as_string()
    query = select(job_task_id, Task.id).where(Task.loop_id == loop_id, job_task_id.in_(wanted))
    if dataset_id is not None:
        query = query.join(DatasetTask, DatasetTask.task_id == Task.id).where(
            DatasetTask.dataset_id == dataset_id
        )
    if among is not None:
        query = query.where(Task.id == any_(_ids(among)))
    return {row[0]: int(row[1]) for row in session.execute(query).all()}


@dataclass(frozen=True)
class TaskContent:
    spec: dict[str, Any]
    cluster_id: str
    sources: list[int]


def task_contents(*, session: Session, task_ids: Sequence[int]) -> dict[int, TaskContent]:
    """Spec, cluster and source trace ids of each task (what a task file line holds)."""
    if not task_ids:
        return {}
    rows = session.execute(
        select(Task.id, Task.spec, Task.cluster_id).where(Task.id == any_(_ids(task_ids)))
    ).all()
    sources: dict[int, list[int]] = {}
    for task_id, trace_id in session.execute(
        select(TaskSource.task_id, TaskSource.trace_id)
        .where(TaskSource.task_id == any_(_ids(task_ids)))
        .order_by(TaskSource.task_id, TaskSource.trace_id)
    ).all():
        sources.setdefault(task_id, []).append(trace_id)
    return {row[0]: TaskContent(row[1], row[2], sources.get(row[0], [])) for row in rows}


def task_with_loop_name(*, session: Session, task_id: int) -> tuple[Task, str] | None:
    """A task and the name of its loop (what a task looked up by its row id is shown with)."""
    row = session.execute(
        select(Task, Loop.name).join(Loop, Loop.id == Task.loop_id).where(Task.id == task_id)
    ).first()
    return None if row is None else (row[0], row[1])

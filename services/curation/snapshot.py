"""Dataset snapshots: freeze a loop's tasks into an immutable, content-addressed dataset.

:func:`snapshot` picks

- **train**: the loop's train tasks (never pinned, never set aside, never eval or
  held-out), after the difficulty filter; when more than ``max_train_tasks`` remain, a
  weighted sample of that many without replacement, a task's weight being the traces
  folded into it by dedup (so a failure seen twenty times is likelier in than one seen
  once, as in production);
- **eval**: the loop's eval tasks, newest first up to ``max_eval_tasks``;
- **regression**: every pinned task, then the newest sampled successes of clusters on the
  judged side, up to ``max_regression_tasks`` (pinned ones are always included);
- **replay**: the newest sampled successes of clusters on the trained side (they hold train
  tasks, or their hash would put a failure there; :mod:`services.curation.splits`), up to
  ``max_replay_tasks``: what a train job replays, never what judges its candidate;
- **heldout**: the loop's whole frozen held-out set (capped at curation by
  ``heldout_max_tasks``), sampled from all curated traffic; evaluated for points gained,
  never trained on;

hashes the selection (sha256 over the sorted ``split, task content hash, weight`` lines, and
a replay loop's tool-response store version),
and either returns the dataset that already has that hash or writes the JSONL task files
(``train.jsonl``, ``replay.jsonl``, ``eval.jsonl``, ``regression.jsonl``, ``heldout.jsonl``,
``ratchet.task/v1``)
plus a ``manifest.json`` (and, for a replay loop, its tool-response store as
``tool_responses.jsonl``, whose version the manifest records) under
``ArtifactStore.dataset_dir(loop, hash)`` and records the ``datasets`` and
``dataset_tasks`` rows. Same content, same dataset: calling it twice, or from a retried
activity, never makes a second row or different files.

Each task line's ``metadata.ratchet`` carries its lineage: task id, cluster, split, weight
and the ids of the traces it came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import ArtifactStore, path_to_uri, uri_to_path
from services.curation.difficulty import select_by_difficulty
from services.curation.policy import CurationPolicy
from services.curation.results import DatasetFiles
from services.curation.splits import replays_with_its_cluster
from services.db.models import Dataset, Loop
from services.db.queries import datasets as dataset_queries
from services.db.queries import replay as replay_queries
from services.db.queries import tasks as task_queries
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import SessionFactory
from services.environments.base import TaskSpec, write_task_file
from services.environments.replay.env import ENVIRONMENT_NAME as REPLAY
from services.environments.replay.records import STORE_FILE, write_store_file
from services.training.checkpoint_manifest import sha256_file

logger = logging.getLogger(__name__)

DATASET_SCHEMA = "ratchet.dataset/v1"
FILES = {
    "train": "train.jsonl",
    "eval": "eval.jsonl",
    "regression": "regression.jsonl",
    "heldout": "heldout.jsonl",
    "replay": "replay.jsonl",
}
_CHUNK = 1_000


class SnapshotError(Exception):
    """A snapshot that cannot succeed by retrying (unknown loop, broken invariant, lost files)."""


@dataclass
class DatasetSnapshot(DatasetFiles):
    """A snapshot's dataset; ``created``: this call wrote it (else it existed already)."""

    created: bool = False


@dataclass(frozen=True)
class _Selection:
    members: dict[str, list[task_queries.SplitMember]]
    difficulty: dict[str, int]
    # A replay loop's tool-response store version: part of what its jobs read, so answers
    # recorded since the last snapshot (live tool answers included) make a new dataset.
    tool_store_version: int | None = None

    def lines(self) -> list[str]:
        lines = sorted(
            f"{split}\t{m.dedup_key}\t{m.weight}"
            for split, members in self.members.items()
            for m in members
        )
        if self.tool_store_version is not None:
            lines.append(f"tool_store\t{self.tool_store_version}")
        return lines

    def content_hash(self) -> str:
        digest = hashlib.sha256()
        for line in self.lines():
            digest.update(line.encode("utf-8") + b"\n")
        return digest.hexdigest()


def snapshot(
    session_factory: SessionFactory,
    store: ArtifactStore,
    *,
    loop_name: str,
    cycle: int | None = None,
) -> DatasetSnapshot:
    """Freeze the loop's current tasks into a dataset (see the module docstring)."""
    with session_factory.begin() as session:
        # One consistent view of the tasks, even while curation keeps adding some.
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        try:
            loop = require_loop(session=session, name=loop_name)
        except NotFound as exc:
            raise SnapshotError(str(exc)) from None
        policy = CurationPolicy.from_json(loop.curation_policy)
        selection = _select(session, loop=loop, policy=policy)
        content_hash = selection.content_hash()
        existing = dataset_queries.dataset_by_hash(
            session=session, loop_id=loop.id, content_hash=content_hash
        )
        if existing is not None:
            _check_files(existing)
            return _as_snapshot(existing, created=False)
        directory = store.dataset_dir(loop.name, content_hash)
        _write_files(session, directory, loop=loop, selection=selection, content_hash=content_hash)
        return _record(
            session,
            directory,
            loop=loop,
            selection=selection,
            content_hash=content_hash,
            cycle=cycle,
        )


def _record(
    session: Session,
    directory: Path,
    *,
    loop: Loop,
    selection: _Selection,
    content_hash: str,
    cycle: int | None,
) -> DatasetSnapshot:
    """The dataset row and its task rows for files already written under ``directory``; a
    concurrent snapshot of the same content that won the insert is returned instead."""
    uris = {split: path_to_uri(directory / name) for split, name in FILES.items()}
    counts = {split: len(members) for split, members in selection.members.items()}
    dataset_id = dataset_queries.insert_dataset(
        session=session,
        values={
            "loop_id": loop.id,
            "content_hash": content_hash,
            "train_count": counts["train"],
            "eval_count": counts["eval"],
            "regression_count": counts["regression"],
            "train_uri": uris["train"],
            "eval_uri": uris["eval"],
            "regression_uri": uris["regression"],
            "heldout_count": counts["heldout"],
            "heldout_uri": uris["heldout"],
            "replay_count": counts["replay"],
            "replay_uri": uris["replay"],
            "stats": json.dumps(_stats(directory, selection=selection, cycle=cycle)),
        },
    )
    if dataset_id is None:  # a concurrent snapshot with the same content won the insert
        raced = dataset_queries.dataset_by_hash(
            session=session, loop_id=loop.id, content_hash=content_hash
        )
        if raced is None:
            raise SnapshotError(f"dataset {content_hash[:12]} vanished during the snapshot")
        return _as_snapshot(raced, created=False)
    dataset_queries.insert_dataset_tasks(
        session=session,
        dataset_id=dataset_id,
        members=[
            (m.task_id, split) for split, members in selection.members.items() for m in members
        ],
    )
    logger.info(
        "dataset %s of loop %s: %d train, %d replay, %d eval, %d regression, %d held-out",
        content_hash[:12],
        loop.name,
        counts["train"],
        counts["replay"],
        counts["eval"],
        counts["regression"],
        counts["heldout"],
    )
    return DatasetSnapshot(
        dataset_id=dataset_id,
        content_hash=content_hash,
        train_count=counts["train"],
        eval_count=counts["eval"],
        regression_count=counts["regression"],
        train_uri=uris["train"],
        eval_uri=uris["eval"],
        regression_uri=uris["regression"],
        created=True,
        difficulty=dict(selection.difficulty),
        heldout_count=counts["heldout"],
        heldout_uri=uris["heldout"],
        replay_count=counts["replay"],
        replay_uri=uris["replay"],
    )


def _stats(directory: Path, *, selection: _Selection, cycle: int | None) -> dict[str, object]:
    """The dataset row's ``stats``: the cycle, the difficulty filter's counts, each split's
    total weight and the manifest's location."""
    return {
        "cycle": cycle,
        "difficulty": selection.difficulty,
        "weights": {
            split: sum(m.weight for m in members) for split, members in selection.members.items()
        },
        "manifest_uri": path_to_uri(directory / "manifest.json"),
    }


def _select(session: Session, *, loop: Loop, policy: CurationPolicy) -> _Selection:
    train = task_queries.split_members(session=session, loop_id=loop.id, split="train")
    if policy.difficulty_filter:
        chosen = select_by_difficulty({m.task_id: m.probe_pass_rate for m in train})
        difficulty = chosen.counts()
        train = [m for m in train if m.task_id in chosen.kept]
    else:
        difficulty = {"kept": len(train), "too_easy": 0, "too_hard": 0, "unprobed": 0}
    train = weighted_sample(train, policy.max_train_tasks)
    evaluation = task_queries.split_members(session=session, loop_id=loop.id, split="eval")[
        : policy.max_eval_tasks
    ]
    regression, replay = _successes(session, loop=loop, policy=policy)
    heldout = task_queries.split_members(session=session, loop_id=loop.id, split="heldout")
    crossing = dataset_queries.clusters_crossing_trained_line(
        session=session,
        loop_id=loop.id,
        trained_ids=[m.task_id for m in train + replay],
        judged_ids=[m.task_id for m in regression if not m.pinned],
    )
    if crossing:
        raise SnapshotError(
            f"loop {loop.name!r}: clusters {', '.join(c[:12] for c in crossing)} have tasks "
            "trained on (train, replay) and tasks that judge (eval, held-out, regression); "
            "refusing to write a leaking dataset"
        )
    return _Selection(
        members={
            "train": train,
            "replay": replay,
            "eval": evaluation,
            "regression": regression,
            "heldout": heldout,
        },
        difficulty=difficulty,
        tool_store_version=(
            replay_queries.tool_store_version(session=session, loop_id=loop.id)
            if loop.environment == REPLAY
            else None
        ),
    )


def _successes(
    session: Session, *, loop: Loop, policy: CurationPolicy
) -> tuple[list[task_queries.SplitMember], list[task_queries.SplitMember]]:
    """The regression suite (every pinned task, then the newest unpinned successes of
    clusters on the judged side, up to ``max_regression_tasks``) and the replay pool (the
    newest successes of clusters on the trained side, up to ``max_replay_tasks``), by
    :func:`services.curation.splits.replays_with_its_cluster`."""
    candidates = task_queries.split_members(session=session, loop_id=loop.id, split="regression")
    pinned = [m for m in candidates if m.pinned]
    unpinned = [m for m in candidates if not m.pinned]
    stored = task_queries.cluster_splits(
        session=session, loop_id=loop.id, cluster_ids=sorted({m.cluster_id for m in unpinned})
    )
    judged: list[task_queries.SplitMember] = []
    replay: list[task_queries.SplitMember] = []
    for member in unpinned:
        trained_side = replays_with_its_cluster(
            member.cluster_id,
            stored.get(member.cluster_id),
            eval_fraction=policy.eval_fraction,
            heldout_fraction=policy.heldout_fraction,
        )
        (replay if trained_side else judged).append(member)
    room = max(policy.max_regression_tasks - len(pinned), 0)
    return pinned + judged[:room], replay[: policy.max_replay_tasks]


def weighted_sample(
    members: Sequence[task_queries.SplitMember], k: int
) -> list[task_queries.SplitMember]:
    """``k`` members drawn without replacement with probability proportional to weight.

    Efraimidis-Spirakis: each member gets the key ``-ln(u) / weight`` and the ``k`` smallest
    keys win. ``u`` comes from the task's content hash, so the draw is a pure function of the
    tasks (a snapshot stays content-addressed and a retry draws the same) and a task keeps
    its key from one cycle to the next. All members are kept, in their order, when they fit.
    """
    if len(members) <= k:
        return list(members)

    def key(member: task_queries.SplitMember) -> float:
        digest = hashlib.sha256(b"ratchet/sample/" + member.dedup_key.encode()).digest()
        u = (int.from_bytes(digest[:8], "big") + 1) / (2**64 + 1)  # in (0, 1)
        return -math.log(u) / max(member.weight, 1)

    chosen = {m.task_id for m in sorted(members, key=key)[:k]}
    return [m for m in members if m.task_id in chosen]


def _write_files(
    session: Session,
    directory: Path,
    *,
    loop: Loop,
    selection: _Selection,
    content_hash: str,
) -> None:
    """Write the task files and manifest into ``directory`` atomically (temp dir + rename)."""
    if (directory / "manifest.json").is_file() and _manifest_hash(directory) == content_hash:
        return  # written by an earlier attempt that did not get to commit its rows
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{content_hash}.{uuid.uuid4().hex[:8]}.tmp"
    staging.mkdir()
    try:
        files: dict[str, dict[str, Any]] = {}
        tool_store = _write_tool_store(session, staging, loop=loop)
        store_path = directory / STORE_FILE if tool_store is not None else None
        for split, name in FILES.items():
            members = sorted(selection.members[split], key=lambda m: m.dedup_key)
            lines = task_lines(session, members, split, tool_store=store_path)
            count = write_task_file(staging / name, lines)
            files[name] = {"count": count, "sha256": sha256_file(staging / name)}
        manifest: dict[str, Any] = {
            "schema": DATASET_SCHEMA,
            "loop": loop.name,
            "environment": loop.environment,
            "content_hash": content_hash,
            "files": files,
            "difficulty": selection.difficulty,
        }
        if tool_store is not None:
            manifest["tool_store"] = tool_store
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        try:
            staging.rename(directory)
        except OSError:
            # A concurrent snapshot of the same content renamed first; its files are ours.
            if _manifest_hash(directory) != content_hash:
                raise SnapshotError(
                    f"{directory} exists and is not dataset {content_hash[:12]}; move it away"
                ) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _write_tool_store(session: Session, staging: Path, *, loop: Loop) -> dict[str, Any] | None:
    """A replay loop's tool-response store as ``tool_responses.jsonl`` beside the task
    files, the store's version (its newest row id) and the file's hash for the manifest;
    None for other environments. Jobs read this file, never the table."""
    if loop.environment != REPLAY:
        return None
    version, calls = replay_queries.tool_store(session=session, loop_id=loop.id)
    count = write_store_file(staging / STORE_FILE, calls)
    return {
        "file": STORE_FILE,
        "version": version,
        "count": count,
        "sha256": sha256_file(staging / STORE_FILE),
    }


def task_lines(
    session: Session,
    members: Sequence[task_queries.SplitMember],
    split: str,
    *,
    tool_store: Path | None = None,
) -> Iterator[TaskSpec]:
    """Task file lines with their ``metadata.ratchet`` lineage, fetched a chunk at a time so
    memory stays flat for large files (datasets and the probe's task file); ``tool_store``
    names the replay store file the tasks' tools answer from."""
    for start in range(0, len(members), _CHUNK):
        chunk = members[start : start + _CHUNK]
        contents = task_queries.task_contents(session=session, task_ids=[m.task_id for m in chunk])
        for member in chunk:
            yield _task_line(member, split, contents[member.task_id], tool_store)


def _task_line(
    member: task_queries.SplitMember,
    split: str,
    content: task_queries.TaskContent,
    tool_store: Path | None = None,
) -> TaskSpec:
    task = TaskSpec.from_json(content.spec)
    lineage = {
        "task_id": member.task_id,
        "content_hash": member.dedup_key,
        "cluster_id": content.cluster_id,
        "split": split,
        "weight": member.weight,
        "source_traces": content.sources,
    }
    if tool_store is not None:
        lineage["tool_store"] = str(tool_store)
    return dataclasses.replace(task, metadata={**task.metadata, "ratchet": lineage})


def _manifest_hash(directory: Path) -> str | None:
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    value = manifest.get("content_hash") if isinstance(manifest, dict) else None
    return value if isinstance(value, str) else None


def _check_files(dataset: Dataset) -> None:
    uris: Sequence[str | None] = (
        dataset.train_uri,
        dataset.eval_uri,
        dataset.regression_uri,
        dataset.heldout_uri,
        dataset.replay_uri,
    )
    missing = [u for u in uris if u is not None and not uri_to_path(u).is_file()]
    if missing:
        raise SnapshotError(
            f"dataset {dataset.id} ({dataset.content_hash[:12]}) is recorded but its files are "
            f"gone: {', '.join(missing)}; restore the artifact store"
        )


def _as_snapshot(dataset: Dataset, *, created: bool) -> DatasetSnapshot:
    return DatasetSnapshot(
        dataset_id=dataset.id,
        content_hash=dataset.content_hash,
        train_count=dataset.train_count,
        eval_count=dataset.eval_count,
        regression_count=dataset.regression_count,
        train_uri=dataset.train_uri,
        eval_uri=dataset.eval_uri,
        regression_uri=dataset.regression_uri,
        created=created,
        difficulty=_difficulty_of(dataset),
        heldout_count=dataset.heldout_count,
        heldout_uri=dataset.heldout_uri,
        replay_count=dataset.replay_count,
        replay_uri=dataset.replay_uri,
    )


def _difficulty_of(dataset: Dataset) -> dict[str, int]:
    stats = dataset.stats if isinstance(dataset.stats, dict) else {}
    counts = stats.get("difficulty")
    if not isinstance(counts, dict):
        return {}
    return {str(k): int(v) for k, v in counts.items() if isinstance(v, int)}

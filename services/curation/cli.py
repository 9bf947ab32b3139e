"""``ratchet tasks list|show|pin`` and ``ratchet datasets list|show|export``.

Read-mostly views of what curation produced, for operators: which tasks a loop has, where a
task came from (its traces), which datasets exist and what is in them. ``--json`` prints
machine-readable output for scripts. ``tasks pin`` moves tasks into the loop's pinned
regression suite (never trained on). Each group is registered by :func:`register_tasks`
and :func:`register_datasets`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import uri_to_path
from services.cli import CliError
from services.cli.db import database_url
from services.db.models import Dataset, Loop, Task
from services.db.queries import datasets as dataset_queries
from services.db.queries import tasks as task_queries
from services.db.queries.errors import NotFound
from services.db.queries.loops import require_loop
from services.db.session import create_db_engine, make_session_factory
from services.progress import Progress

SPLITS = ("train", "eval", "heldout", "regression")


def register_tasks(subparsers: Any) -> None:
    tasks = subparsers.add_parser("tasks", help="curated RL tasks of a loop")
    commands = tasks.add_subparsers(dest="tasks_command", metavar="COMMAND", required=True)
    listing = commands.add_parser("list", help="list a loop's tasks, newest first")
    listing.add_argument("--loop", required=True, help="loop name")
    listing.add_argument("--split", choices=SPLITS, help="only tasks of this split")
    listing.add_argument("--limit", type=_positive, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_tasks_list)
    show = commands.add_parser("show", help="one task: spec, cluster, split, source traces")
    show.add_argument("task_id", type=_positive)
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_tasks_show)
    pin = commands.add_parser("pin", help="put tasks into the loop's pinned regression suite")
    pin.add_argument("--loop", required=True, help="loop name")
    pin.add_argument("task_ids", type=_positive, nargs="+")
    pin.set_defaults(func=_tasks_pin)


def register_datasets(subparsers: Any) -> None:
    datasets = subparsers.add_parser("datasets", help="immutable dataset snapshots of a loop")
    commands = datasets.add_subparsers(dest="datasets_command", metavar="COMMAND", required=True)
    listing = commands.add_parser("list", help="list a loop's datasets, newest first")
    listing.add_argument("--loop", required=True, help="loop name")
    listing.add_argument("--limit", type=_positive, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_datasets_list)
    show = commands.add_parser("show", help="one dataset: counts, files, statistics")
    show.add_argument("dataset_id", type=_positive)
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_datasets_show)
    export = commands.add_parser("export", help="copy a dataset's task files into a directory")
    export.add_argument("dataset_id", type=_positive)
    export.add_argument("--out", type=Path, required=True, help="destination directory")
    export.set_defaults(func=_datasets_export)


def _positive(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


@contextmanager
def _session() -> Iterator[Session]:
    """A session on the configured database (or the embedded one, as ``ratchet db`` does)."""
    with database_url() as url:
        engine = create_db_engine(url, pool_size=1, application="ratchet-cli")
        try:
            with make_session_factory(engine).begin() as session:
                yield session
        finally:
            engine.dispose()


def _loop(session: Session, name: str) -> Loop:
    try:
        return require_loop(session=session, name=name)
    except NotFound:
        raise CliError(
            f"no loop named {name!r}; `ratchet loop list` shows the loops", exit_code=1
        ) from None


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def _task_summary(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "split": task.split,
        "origin": task.origin,
        "weight": task.weight,
        "pinned": task.pinned,
        "cluster_id": task.cluster_id,
        "content_hash": task.content_hash,
        "probe_pass_rate": task.probe_pass_rate,
        "redactions": task.redactions,
        "created_at": task.created_at.isoformat(),
    }


def _tasks_list(args: argparse.Namespace) -> int:
    with _session() as session:
        loop = _loop(session, args.loop)
        tasks = task_queries.list_tasks(
            session=session, loop_id=loop.id, split=args.split, limit=args.limit
        )
        if args.json:
            _print_json([_task_summary(t) for t in tasks])
            return 0
        print(f"{'ID':>8}  {'SPLIT':<10} {'ORIGIN':<8} {'WEIGHT':>6}  {'CLUSTER':<12}  PROMPT")
        for task in tasks:
            prompt = " ".join(str(task.spec.get("prompt", "")).split())[:60]
            print(
                f"{task.id:>8}  {task.split:<10} {task.origin:<8} {task.weight:>6}  "
                f"{task.cluster_id[:12]:<12}  {prompt}"
            )
        if not tasks:
            print(f"loop {loop.name!r} has no tasks yet")
    return 0


def _tasks_show(args: argparse.Namespace) -> int:
    with _session() as session:
        task = task_queries.get_task(session=session, task_id=args.task_id)
        if task is None:
            raise CliError(f"no task {args.task_id}", exit_code=1)
        sources = task_queries.task_sources(session=session, task_id=task.id)
        detail = {
            **_task_summary(task),
            "failure_signature": task.failure_signature,
            "spec": task.spec,
            "sources": [{"trace_id": t, "external_id": e, "relation": r} for t, e, r in sources],
        }
        if args.json:
            _print_json(detail)
            return 0
        for key in ("id", "split", "origin", "weight", "pinned", "cluster_id", "content_hash"):
            print(f"{key:<18}{detail[key]}")
        print(f"{'probe_pass_rate':<18}{detail['probe_pass_rate']}")
        print(f"{'failure':<18}{detail['failure_signature']}")
        print(f"{'redactions':<18}{json.dumps(detail['redactions'], sort_keys=True)}")
        print(f"{'verifier':<18}{json.dumps(task.spec.get('verifier'), sort_keys=True)}")
        print("prompt:")
        print("  " + str(task.spec.get("prompt", "")).replace("\n", "\n  "))
        print(f"sources ({len(sources)}):")
        for trace_id, external_id, relation in sources:
            print(f"  trace {trace_id:<8} {relation:<15} {external_id}")
    return 0


def _tasks_pin(args: argparse.Namespace) -> int:
    with _session() as session:
        loop = _loop(session, args.loop)
        pinned = task_queries.pin_tasks(session=session, loop_id=loop.id, task_ids=args.task_ids)
        refused = sorted(set(args.task_ids) - set(pinned))
        if refused:  # raising rolls the whole pin back
            raise CliError(
                f"tasks {', '.join(map(str, refused))} are not tasks of loop {loop.name!r} or are "
                "held out (the held-out set is frozen); nothing was pinned",
                exit_code=1,
            )
    print(f"pinned {len(pinned)} task(s) to the regression suite of {args.loop}")
    return 0


def _dataset_summary(dataset: Dataset) -> dict[str, Any]:
    return {
        "id": dataset.id,
        "content_hash": dataset.content_hash,
        "train_count": dataset.train_count,
        "eval_count": dataset.eval_count,
        "regression_count": dataset.regression_count,
        "train_uri": dataset.train_uri,
        "eval_uri": dataset.eval_uri,
        "regression_uri": dataset.regression_uri,
        "stats": dataset.stats,
        "created_at": dataset.created_at.isoformat(),
    }


def _datasets_list(args: argparse.Namespace) -> int:
    with _session() as session:
        loop = _loop(session, args.loop)
        datasets = dataset_queries.list_datasets(session=session, loop_id=loop.id, limit=args.limit)
        if args.json:
            _print_json([_dataset_summary(d) for d in datasets])
            return 0
        print(f"{'ID':>6}  {'HASH':<12}  {'TRAIN':>6} {'EVAL':>6} {'REGR':>6}  CREATED")
        for d in datasets:
            print(
                f"{d.id:>6}  {d.content_hash[:12]:<12}  {d.train_count:>6} {d.eval_count:>6} "
                f"{d.regression_count:>6}  {d.created_at:%Y-%m-%d %H:%M:%S}"
            )
        if not datasets:
            print(f"loop {loop.name!r} has no datasets yet")
    return 0


def _dataset(session: Session, dataset_id: int) -> Dataset:
    dataset = dataset_queries.get_dataset(session=session, dataset_id=dataset_id)
    if dataset is None:
        raise CliError(f"no dataset {dataset_id}", exit_code=1)
    return dataset


def _datasets_show(args: argparse.Namespace) -> int:
    with _session() as session:
        dataset = _dataset(session, args.dataset_id)
        summary = _dataset_summary(dataset)
        lineage = dataset_queries.dataset_lineage(session=session, dataset_id=dataset.id)
        summary["source_traces"] = len({trace for _, _, trace in lineage})
        if args.json:
            _print_json(summary)
            return 0
        for key, value in summary.items():
            if key != "stats":
                print(f"{key:<18}{value}")
        print(f"{'difficulty':<18}{json.dumps(dataset.stats.get('difficulty'), sort_keys=True)}")
    return 0


def _copy_with_progress(source: Path, target: Path, progress: Progress) -> None:
    """Copy in chunks, reporting each (a dataset's task files can be gigabytes)."""
    with source.open("rb") as reader, target.open("wb") as writer:
        for chunk in iter(lambda: reader.read(1 << 20), b""):
            writer.write(chunk)
            progress.advance(len(chunk))
    shutil.copystat(source, target)


def _datasets_export(args: argparse.Namespace) -> int:
    with _session() as session:
        dataset = _dataset(session, args.dataset_id)
        uris = [dataset.train_uri, dataset.eval_uri, dataset.regression_uri]
    sources = [uri_to_path(u) for u in uris if u is not None]
    manifest = sources[0].parent / "manifest.json"
    missing = [str(p) for p in [*sources, manifest] if not p.is_file()]
    if missing:
        raise CliError(f"dataset files are missing: {', '.join(missing)}", exit_code=1)
    args.out.mkdir(parents=True, exist_ok=True)
    files = [*sources, manifest]
    total = sum(path.stat().st_size for path in files)
    with Progress(f"exporting dataset {dataset.id}", total=total, unit="B") as progress:
        for path in files:
            _copy_with_progress(path, args.out / path.name, progress)
    print(f"exported dataset {dataset.id} ({dataset.content_hash[:12]}) to {args.out}")
    return 0

"""``ratchet datasets list|show|export``: the immutable dataset snapshots of a loop.

Which datasets exist, what is in them and how many traces they came from; ``export`` copies
a dataset's task files (with their manifest) into a directory; ``--json`` prints
machine-readable output for scripts.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from services.artifacts import uri_to_path
from services.cli import CliError
from services.cli.common import (
    add_command,
    add_loop_argument,
    command_group,
    database_session,
    positive_int,
    print_json,
)
from services.cli.listing import Listing, row_summary
from services.db.models import Dataset
from services.db.queries import datasets as q
from services.progress import Progress


def register(subparsers: Any) -> None:
    commands = command_group(subparsers, "datasets", help="immutable dataset snapshots of a loop")
    listing = add_command(
        commands, "list", _datasets_list, help="list a loop's datasets, newest first"
    )
    add_loop_argument(listing, positional=True)
    listing.add_argument("--limit", type=positive_int, default=50)
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = add_command(
        commands, "show", _datasets_show, help="one dataset: counts, files, statistics"
    )
    show.add_argument("dataset_id", type=positive_int)
    show.add_argument("--json", action="store_true", help="print JSON")
    export = add_command(
        commands, "export", _datasets_export, help="copy a dataset's task files into a directory"
    )
    export.add_argument("dataset_id", type=positive_int)
    export.add_argument("--out", type=Path, required=True, help="destination directory")


DATASET_COLUMNS = (
    "id",
    "content_hash",
    "train_count",
    "eval_count",
    "regression_count",
    "train_uri",
    "eval_uri",
    "regression_uri",
    "stats",
    "created_at",
)


def _dataset_line(dataset: Dataset) -> str:
    return (
        f"{dataset.id:>6}  {dataset.content_hash[:12]:<12}  {dataset.train_count:>6} "
        f"{dataset.eval_count:>6} {dataset.regression_count:>6}  "
        f"{dataset.created_at:%Y-%m-%d %H:%M:%S}"
    )


DATASETS = Listing(
    noun="datasets",
    columns=DATASET_COLUMNS,
    header=f"{'ID':>6}  {'HASH':<12}  {'TRAIN':>6} {'EVAL':>6} {'REGR':>6}  CREATED",
    line=_dataset_line,
)


def _datasets_list(args: argparse.Namespace) -> int:
    return DATASETS.list_for_loop(
        args,
        lambda session, loop: q.list_datasets(session=session, loop_id=loop.id, limit=args.limit),
    )


def _dataset(session: Session, dataset_id: int) -> Dataset:
    dataset = q.get_dataset(session=session, dataset_id=dataset_id)
    if dataset is None:
        raise CliError(f"no dataset {dataset_id}", exit_code=1)
    return dataset


def _datasets_show(args: argparse.Namespace) -> int:
    with database_session() as session:
        dataset = _dataset(session, args.dataset_id)
        summary = row_summary(dataset, DATASET_COLUMNS)
        lineage = q.dataset_lineage(session=session, dataset_id=dataset.id)
        summary["source_traces"] = len({trace for _, _, trace in lineage})
        if args.json:
            print_json(summary)
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
    with database_session() as session:
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

"""``ratchet datasets list|show|export``: the immutable dataset snapshots of a loop.

Which datasets exist, what is in them and how many traces they came from, through the admin
API (services.client), as ``ratchet loop`` does; ``--json`` prints what the api answered.
``export`` copies a dataset's task files (with their manifest) into a directory: it asks the
api where they are and reads them from the artifact store, so it runs where that store is
mounted (the machine of a local stack, or a pod with the artifacts volume).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from services.api.schemas.tasks import DatasetPublic
from services.argtypes import positive_int
from services.artifacts import uri_to_path
from services.cli import CliError
from services.cli.common import (
    add_command,
    add_loop_argument,
    call_api,
    command_group,
    loop_name,
    print_json,
)
from services.cli.listing import Listing
from services.progress import Progress


def register(subparsers: Any) -> None:
    commands = command_group(subparsers, "datasets", help="immutable dataset snapshots of a loop")
    listing = add_command(
        commands, "list", _datasets_list, help="list a loop's datasets, newest first"
    )
    add_loop_argument(listing, positional=True)
    listing.add_argument("--limit", type=positive_int, default=50, help="datasets per page")
    listing.add_argument("--cursor", help="next_cursor of a previous page")
    listing.add_argument("--json", action="store_true", help="print the page as JSON")
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


def _dataset_line(dataset: DatasetPublic) -> str:
    return (
        f"{dataset.id:>6}  {dataset.content_hash[:12]:<12}  {dataset.train_count:>6} "
        f"{dataset.eval_count:>6} {dataset.regression_count:>6}  "
        f"{dataset.created_at:%Y-%m-%d %H:%M:%S}"
    )


DATASETS = Listing(
    noun="datasets",
    command="datasets list",
    header=f"{'ID':>6}  {'HASH':<12}  {'TRAIN':>6} {'EVAL':>6} {'REGR':>6}  CREATED",
    line=_dataset_line,
)


def _datasets_list(args: argparse.Namespace) -> int:
    """List a loop's dataset snapshots, newest first (a page at a time: --cursor)."""
    name = loop_name(args)
    page = call_api(
        lambda client: client.list_datasets(name, cursor=args.cursor, limit=min(args.limit, 500))
    )
    DATASETS.print_page(page, page.datasets, page.next_cursor, loop=name, as_json=args.json)
    return 0


def _datasets_show(args: argparse.Namespace) -> int:
    """One dataset: its counts per split, files, difficulty statistics and how many traces
    its tasks came from."""
    dataset = call_api(lambda client: client.get_dataset(args.dataset_id))
    summary = dataset.model_dump(mode="json")
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
    """Copy a dataset's task files (train, eval, regression, held-out and replay JSONL) and
    its manifest into --out, from the artifact store the api names."""
    dataset = call_api(lambda client: client.get_dataset(args.dataset_id))
    uris = [
        dataset.train_uri,
        dataset.eval_uri,
        dataset.regression_uri,
        dataset.heldout_uri,
        dataset.replay_uri,
    ]
    try:
        sources = [uri_to_path(u) for u in uris if u is not None]
    except ValueError as exc:  # an object-store URI: not a file this command can read
        raise CliError(str(exc), exit_code=1) from None
    manifest = sources[0].parent / "manifest.json"
    missing = [str(p) for p in [*sources, manifest] if not p.is_file()]
    if missing:
        raise CliError(
            f"dataset files are missing here: {', '.join(missing)} (export runs where the "
            "artifact store is mounted)",
            exit_code=1,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    files = [*sources, manifest]
    total = sum(path.stat().st_size for path in files)
    with Progress(f"exporting dataset {dataset.id}", total=total, unit="B") as progress:
        for path in files:
            _copy_with_progress(path, args.out / path.name, progress)
    print(f"exported dataset {dataset.id} ({dataset.content_hash[:12]}) to {args.out}")
    return 0
